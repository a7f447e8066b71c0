//! The open connections, what each is doing, and which gives way when the server is full.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Every open connection, by id.
#[derive(Debug, Clone)]
pub(super) struct Connections {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    open: Mutex<Open>,
    limit: usize,
    emptied: Notify,
    /// What `since` counts from.
    epoch: Instant,
}

#[derive(Debug, Default)]
struct Open {
    next_id: u64,
    by_id: HashMap<u64, Arc<Entry>>,
}

/// One connection as the server sees it. The counts are changed by the connection's own
/// requests without taking the lock over all connections.
#[derive(Debug)]
struct Entry {
    /// When the connection last completed a request, or was accepted: nanoseconds since the
    /// epoch of [`Inner`].
    since: AtomicU64,
    /// Requests whose body has been read and whose response has not ended: work under way.
    busy: AtomicUsize,
    /// Requests whose headers arrived and whose body is still arriving.
    receiving: AtomicUsize,
    close: Notify,
}

impl Entry {
    /// Whether the connection is doing nothing that was asked of it: idle, reading headers, or
    /// receiving a body. Such a connection may be closed to make room.
    fn waiting(&self) -> bool {
        self.busy.load(Ordering::Acquire) == 0
    }

    /// Whether the connection has no request at all: idle or reading headers. Such a
    /// connection is closed after the idle time-out (a body has time-outs of its own).
    fn idle(&self) -> bool {
        self.waiting() && self.receiving.load(Ordering::Acquire) == 0
    }

    fn since(&self) -> u64 {
        self.since.load(Ordering::Acquire)
    }
}

impl Connections {
    pub(super) fn new(limit: usize) -> Connections {
        Connections {
            inner: Arc::new(Inner {
                open: Mutex::new(Open::default()),
                limit,
                emptied: Notify::new(),
                epoch: Instant::now(),
            }),
        }
    }

    fn open(&self) -> MutexGuard<'_, Open> {
        // A panic while the lock was held leaves counts that are still usable.
        self.inner
            .open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes in a new connection. At the limit, the connection that has waited longest without
    /// completing a request is told to close to make room; `None` if every connection has work
    /// under way.
    pub(super) fn admit(&self) -> Option<Slot> {
        let mut open = self.open();
        if open.by_id.len() >= self.inner.limit {
            let oldest = open
                .by_id
                .iter()
                .filter(|(_, entry)| entry.waiting())
                .min_by_key(|(_, entry)| entry.since())
                .map(|(id, _)| *id)?;
            if let Some(entry) = open.by_id.remove(&oldest) {
                tracing::debug!(
                    connection = oldest,
                    "closing the longest-waiting connection to admit a new one"
                );
                entry.close.notify_one();
            }
        }
        let id = open.next_id;
        open.next_id += 1;
        let entry = Arc::new(Entry {
            since: AtomicU64::new(self.now()),
            busy: AtomicUsize::new(0),
            receiving: AtomicUsize::new(0),
            close: Notify::new(),
        });
        open.by_id.insert(id, entry.clone());
        Some(Slot {
            id,
            connections: self.clone(),
            entry,
        })
    }

    /// Closes, every so often, the connections that have completed no request for `idle`.
    pub(super) async fn close_idle(self, idle: Duration) {
        let mut ticks = tokio::time::interval((idle / 4).max(Duration::from_millis(100)));
        loop {
            ticks.tick().await;
            let now = self.now();
            let idle = u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX);
            let mut open = self.open();
            open.by_id.retain(|_, entry| {
                let stale = entry.idle() && now.saturating_sub(entry.since()) >= idle;
                if stale {
                    entry.close.notify_one();
                }
                !stale
            });
        }
    }

    /// Nanoseconds since the epoch.
    fn now(&self) -> u64 {
        u64::try_from(self.inner.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Waits until every connection has closed.
    pub(super) async fn wait_until_empty(&self) {
        loop {
            let emptied = self.inner.emptied.notified();
            if self.open().by_id.is_empty() {
                return;
            }
            emptied.await;
        }
    }

    /// How many connections are open.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.open().by_id.len()
    }
}

/// One connection's place among the open ones.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    id: u64,
    connections: Connections,
    entry: Arc<Entry>,
}

impl Slot {
    /// A request's headers have arrived; its body is coming.
    pub(super) fn request_started(&self) {
        self.entry.receiving.fetch_add(1, Ordering::AcqRel);
    }

    /// A request's body has been read: its work is under way.
    pub(super) fn request_read(&self) {
        self.entry.busy.fetch_add(1, Ordering::AcqRel);
        decrement(&self.entry.receiving);
    }

    /// A response has ended (sent, or dropped); `read` if its request's body had been read.
    pub(super) fn response_ended(&self, read: bool) {
        decrement(if read {
            &self.entry.busy
        } else {
            &self.entry.receiving
        });
        self.entry
            .since
            .store(self.connections.now(), Ordering::Release);
    }

    /// Completes when this connection must close to make room or for idling.
    pub(super) async fn evicted(&self) {
        self.entry.close.notified().await;
    }

    /// The connection has closed.
    pub(super) fn close(&self) {
        let mut open = self.connections.open();
        open.by_id.remove(&self.id);
        if open.by_id.is_empty() {
            self.connections.inner.emptied.notify_waiters();
        }
    }
}

/// Counts one down, never below zero.
fn decrement(count: &AtomicUsize) {
    let _ = count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn at_the_limit_the_longest_waiting_connection_gives_way() {
        let connections = Connections::new(2);
        let first = connections.admit().unwrap();
        let second = connections.admit().unwrap();
        let third = connections.admit().expect("a new connection gets in");
        assert_eq!(connections.len(), 2);
        // The first was told to close; it completes at once.
        tokio::time::timeout(Duration::from_secs(1), first.evicted())
            .await
            .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(50), second.evicted())
                .await
                .is_err()
        );
        drop(third);
    }

    #[tokio::test]
    async fn a_connection_with_work_under_way_is_never_closed_to_make_room() {
        let connections = Connections::new(2);
        let working = connections.admit().unwrap();
        working.request_started();
        working.request_read();
        let waiting = connections.admit().unwrap();
        let _new = connections.admit().unwrap();
        tokio::time::timeout(Duration::from_secs(1), waiting.evicted())
            .await
            .unwrap();
        // Now both open connections are busy or new; a busy one is not a candidate.
        let newest = connections.admit();
        assert!(newest.is_some(), "the new, waiting connection gave way");
        working.request_read();
        let full = Connections::new(1);
        let only = full.admit().unwrap();
        only.request_started();
        only.request_read();
        assert!(full.admit().is_none(), "every connection is busy: refused");
    }

    #[tokio::test(start_paused = true)]
    async fn connections_that_complete_no_request_are_closed_after_the_idle_time_out() {
        let connections = Connections::new(10);
        let idle = connections.admit().unwrap();
        let busy = connections.admit().unwrap();
        busy.request_started();
        busy.request_read();
        let uploading = connections.admit().unwrap();
        uploading.request_started();
        tokio::spawn(connections.clone().close_idle(Duration::from_secs(60)));
        tokio::time::sleep(Duration::from_secs(61)).await;
        tokio::time::timeout(Duration::from_secs(1), idle.evicted())
            .await
            .unwrap();
        assert_eq!(connections.len(), 2, "the busy and the uploading ones stay");
        busy.response_ended(true);
        uploading.response_ended(false);
        tokio::time::sleep(Duration::from_secs(90)).await;
        assert_eq!(connections.len(), 0);
    }
}
