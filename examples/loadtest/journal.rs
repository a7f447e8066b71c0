//! A journal: the least a call can pay to be on disk before its reply.

use std::sync::Arc;

/// What a journal record holds: about a call-log entry's size.
const RECORD: usize = 200;
/// A journal's file, written over and over from the start.
const JOURNAL_FILE: u64 = 64 << 20;

/// Records waiting to be written, and the sequence number of the last one queued.
#[derive(Default)]
struct Queued {
    records: std::sync::Mutex<(Vec<u8>, u64)>,
    wake: std::sync::Condvar,
}

/// The least a call can pay to be on disk before its reply: one thread writes whatever records
/// were queued meanwhile to a file written in full beforehand (so that no write changes its
/// size or its blocks) and `fdatasync`s it, then wakes those records' callers; one write and
/// one flush per batch, as the gateway's flusher does, and nothing else.
#[derive(Clone)]
pub struct Journal {
    queued: Arc<Queued>,
    on_disk: tokio::sync::watch::Receiver<u64>,
}

impl Journal {
    pub fn create(path: &std::path::Path) -> Journal {
        let file = std::fs::File::create(path).unwrap();
        std::io::Write::write_all(&mut &file, &vec![0; JOURNAL_FILE as usize]).unwrap();
        file.sync_all().unwrap();
        let queued = Arc::new(Queued::default());
        let (durable, on_disk) = tokio::sync::watch::channel(0u64);
        let writer = queued.clone();
        std::thread::spawn(move || {
            use std::os::unix::fs::FileExt;
            let (mut offset, mut batch) = (0, Vec::new());
            loop {
                let last = {
                    let mut queued = writer.records.lock().unwrap();
                    while queued.0.is_empty() {
                        queued = writer.wake.wait(queued).unwrap();
                    }
                    std::mem::swap(&mut batch, &mut queued.0);
                    queued.1
                };
                if offset + batch.len() as u64 > JOURNAL_FILE {
                    offset = 0;
                }
                file.write_all_at(&batch, offset).unwrap();
                file.sync_data().unwrap();
                offset += batch.len() as u64;
                batch.clear();
                if durable.send(last).is_err() {
                    return;
                }
            }
        });
        Journal { queued, on_disk }
    }

    /// Queues a record and waits until it is on disk.
    pub async fn record(&self) {
        let sequence = {
            let mut queued = self.queued.records.lock().unwrap();
            queued.0.extend_from_slice(&[b'x'; RECORD]);
            queued.1 += 1;
            queued.1
        };
        self.queued.wake.notify_one();
        self.on_disk
            .clone()
            .wait_for(|durable| *durable >= sequence)
            .await
            .unwrap();
    }
}
