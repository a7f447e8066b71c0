//! The open connections, what each is doing, and which gives way when the server is full.

use std::collections::HashMap;
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
}

#[derive(Debug, Default)]
struct Open {
    next_id: u64,
    by_id: HashMap<u64, Entry>,
}

#[derive(Debug)]
struct Entry {
    /// When the connection last completed a request, or was accepted.
    since: Instant,
    /// Requests whose body has been read and whose response has not ended: work under way.
    busy: usize,
    /// Requests whose headers arrived and whose body is still arriving.
    receiving: usize,
    close: Arc<Notify>,
}

impl Entry {
    /// Whether the connection is doing nothing that was asked of it: idle, reading headers, or
    /// receiving a body. Such a connection may be closed to make room.
    fn waiting(&self) -> bool {
        self.busy == 0
    }

    /// Whether the connection has no request at all: idle or reading headers. Such a
    /// connection is closed after the idle time-out (a body has time-outs of its own).
    fn idle(&self) -> bool {
        self.busy == 0 && self.receiving == 0
    }
}

impl Connections {
    pub(super) fn new(limit: usize) -> Connections {
        Connections {
            inner: Arc::new(Inner {
                open: Mutex::new(Open::default()),
                limit,
                emptied: Notify::new(),
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
                .min_by_key(|(_, entry)| entry.since)
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
        let close = Arc::new(Notify::new());
        open.by_id.insert(
            id,
            Entry {
                since: Instant::now(),
                busy: 0,
                receiving: 0,
                close: close.clone(),
            },
        );
        Some(Slot {
            id,
            connections: self.clone(),
            close,
        })
    }

    /// Closes, every so often, the connections that have completed no request for `idle`.
    pub(super) async fn close_idle(self, idle: Duration) {
        let mut ticks = tokio::time::interval((idle / 4).max(Duration::from_millis(100)));
        loop {
            ticks.tick().await;
            let mut open = self.open();
            let now = Instant::now();
            open.by_id.retain(|_, entry| {
                let stale = entry.idle() && now.duration_since(entry.since) >= idle;
                if stale {
                    entry.close.notify_one();
                }
                !stale
            });
        }
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
    close: Arc<Notify>,
}

impl Slot {
    /// A request's headers have arrived; its body is coming.
    pub(super) fn request_started(&self) {
        if let Some(entry) = self.connections.open().by_id.get_mut(&self.id) {
            entry.receiving += 1;
        }
    }

    /// A request's body has been read: its work is under way.
    pub(super) fn request_read(&self) {
        if let Some(entry) = self.connections.open().by_id.get_mut(&self.id) {
            entry.receiving = entry.receiving.saturating_sub(1);
            entry.busy += 1;
        }
    }

    /// A response has ended (sent, or dropped); `read` if its request's body had been read.
    pub(super) fn response_ended(&self, read: bool) {
        if let Some(entry) = self.connections.open().by_id.get_mut(&self.id) {
            if read {
                entry.busy = entry.busy.saturating_sub(1);
            } else {
                entry.receiving = entry.receiving.saturating_sub(1);
            }
            entry.since = Instant::now();
        }
    }

    /// Completes when this connection must close to make room or for idling.
    pub(super) async fn evicted(&self) {
        self.close.notified().await;
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
