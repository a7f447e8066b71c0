//! What of a stream its client's connection has taken, and the watchdog that ends a stream
//! whose client takes nothing.
//!
//! A stream whose client goes away is billed if content had been written to the client. What
//! counts as written:
//! - **HTTP/1.1 on [`crate::server`]**: bytes the socket accepted. The server counts its
//!   flushes ([`ClientWrites`]); hyper flushes its socket only once its write buffer is empty,
//!   so a frame handed on before a flush is in the socket after it. Bytes in the kernel's
//!   buffers count: the gateway cannot see past them.
//! - **HTTP/2** (and any server that does not count its flushes): bytes the flow-control window
//!   let through. hyper asks for a stream's next frame only once the frame before it had room,
//!   so each ask shows that every frame but the last one handed on went through whole. The last
//!   frame before a client leaves counts only if a later one was asked for; the doubt falls to
//!   the client.
//!
//! A stream that only opened (`message_start`, a role, an empty block) forwarded no content.
//!
//! A client that takes nothing (a closed window, a socket it never reads) stops the server from
//! asking for the stream's frames, so the stream's own deadline never fires. The watchdog ends
//! the call [`WATCHDOG_GRACE`] after that deadline as if the client had left: billed for what it
//! took, refunded otherwise.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;
use std::time::Duration;

use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::guard::{Outcome, UnsettledCall};
use crate::call::ClientWrites;
use crate::protocol::TokenUsage;
use crate::store::CallSuccess;

/// How long after a stream's deadline the watchdog ends a call whose stream the server stopped
/// asking for. A stream still being asked for ends at its deadline, refunded, by itself.
pub(super) const WATCHDOG_GRACE: Duration = Duration::from_secs(1);

/// How the stream learns what its connection took.
#[derive(Debug)]
enum Taken {
    /// Each ask for a frame shows that every frame but the last handed on went through:
    /// `through` is how many had been handed on at the last ask.
    Asked { through: u64 },
    /// The server counts its socket's flushes.
    Flushed(ClientWrites),
}

/// Content handed to the connection, not yet known taken, with the usage to bill once it is:
/// taken once the level of [`Delivery`] is past `epoch`.
#[derive(Debug)]
struct Mark {
    epoch: u64,
    usage: TokenUsage,
}

/// The frames a stream handed to its connection, and which of its content the connection took.
#[derive(Debug)]
pub(super) struct Delivery {
    taken: Taken,
    handed: u64,
    untaken: VecDeque<Mark>,
}

impl Delivery {
    /// Counted by the server's flushes if it counts them, else by its asks.
    pub(super) fn new(writes: Option<ClientWrites>) -> Delivery {
        Delivery {
            taken: writes.map_or(Taken::Asked { through: 0 }, Taken::Flushed),
            handed: 0,
            untaken: VecDeque::new(),
        }
    }

    fn level(&self) -> u64 {
        match &self.taken {
            Taken::Asked { through } => *through,
            Taken::Flushed(writes) => writes.flushes(),
        }
    }

    /// The server asks for the next frame.
    pub(super) fn asked(&mut self) {
        if let Taken::Asked { through } = &mut self.taken {
            *through = self.handed;
        }
    }

    /// A frame is handed on; `content`: the usage read so far, if the frame holds content.
    pub(super) fn handed(&mut self, content: Option<TokenUsage>) {
        self.handed += 1;
        let Some(usage) = content else { return };
        let epoch = match &self.taken {
            Taken::Asked { .. } => self.handed,
            Taken::Flushed(writes) => writes.flushes(),
        };
        // Marks taken at the same moment are one: the newest usage stands for them.
        match self.untaken.back_mut() {
            Some(last) if last.epoch == epoch => last.usage = usage,
            _ => self.untaken.push_back(Mark { epoch, usage }),
        }
        debug_assert!(self.untaken.len() <= 64, "marks pile up: {self:?}");
    }

    /// The usage of the newest content taken since the last call, if any was.
    fn newly_taken(&mut self) -> Option<TokenUsage> {
        let level = self.level();
        let mut newest = None;
        while let Some(mark) = self.untaken.front()
            && mark.epoch < level
        {
            newest = Some(mark.usage);
            self.untaken.pop_front();
        }
        newest
    }

    /// Whether every content frame handed on has been taken (as of the last
    /// [`Shared::confirm`]).
    pub(super) fn all_taken(&self) -> bool {
        self.untaken.is_empty()
    }

    /// Arranges for `waker` to be woken when more may have been taken. (Counted by asks, the
    /// next ask is the wake-up.)
    pub(super) fn wake_when_taken(&self, waker: &Waker) {
        if let Taken::Flushed(writes) = &self.taken {
            writes.wake_at_next_flush(waker);
        }
    }
}

/// What a stream and its watchdog share.
pub(super) struct Shared {
    /// The call while its outcome is unwritten; `None` once the stream or the watchdog took it.
    pub(super) guard: Option<UnsettledCall>,
    pub(super) delivery: Delivery,
    /// What a settle records, but for the usage.
    success: CallSuccess,
}

impl Shared {
    /// Takes note of the content the connection has taken: from then on the call is billed, for
    /// the usage read up to it, if it ends without its end.
    pub(super) fn confirm(&mut self) {
        if let Some(usage) = self.delivery.newly_taken()
            && let Some(guard) = &mut self.guard
        {
            guard.if_dropped(Outcome::Settle(CallSuccess {
                usage,
                ..self.success.clone()
            }));
        }
    }
}

/// A stream's call, watched: if the stream is neither finished nor dropped by `ends_by`, the
/// watchdog writes its outcome.
pub(super) struct WatchedCall {
    shared: Arc<Mutex<Shared>>,
    watchdog: AbortHandle,
}

impl WatchedCall {
    pub(super) fn new(
        guard: UnsettledCall,
        delivery: Delivery,
        success: CallSuccess,
        ends_by: Instant,
    ) -> WatchedCall {
        let shared = Arc::new(Mutex::new(Shared {
            guard: Some(guard),
            delivery,
            success,
        }));
        let watchdog = tokio::spawn(watch(Arc::downgrade(&shared), ends_by)).abort_handle();
        WatchedCall { shared, watchdog }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Ends the call at `ends_by` if nobody has: as if its client had left.
async fn watch(shared: Weak<Mutex<Shared>>, ends_by: Instant) {
    tokio::time::sleep_until(ends_by).await;
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let unwritten = {
        let mut shared = lock(&shared);
        shared.confirm();
        shared.guard.take()
    };
    if let Some(guard) = unwritten {
        tracing::warn!(
            call = guard.call.0,
            "a stream's client took nothing until past the stream's deadline; ended as if it left"
        );
        // Dropped unwritten: its outcome is written on a task of its own.
        drop(guard);
    }
}

impl Drop for WatchedCall {
    fn drop(&mut self) {
        self.watchdog.abort();
        let unwritten = {
            let mut shared = self.lock();
            shared.confirm();
            shared.guard.take()
        };
        drop(unwritten);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(output: i64) -> TokenUsage {
        TokenUsage {
            input_tokens: Some(1),
            output_tokens: Some(output),
            ..Default::default()
        }
    }

    #[test]
    fn asked_content_is_taken_once_a_later_frame_was_asked_for() {
        let mut delivery = Delivery::new(None);
        delivery.asked();
        delivery.handed(Some(usage(1)));
        // Asked again: the frame was given room, not known through.
        delivery.asked();
        assert_eq!(delivery.newly_taken(), None);
        delivery.handed(Some(usage(2)));
        delivery.asked();
        assert_eq!(delivery.newly_taken(), Some(usage(1)));
        assert!(!delivery.all_taken());
        delivery.handed(None);
        delivery.asked();
        assert_eq!(delivery.newly_taken(), Some(usage(2)));
        assert!(delivery.all_taken());
    }

    #[test]
    fn flushed_content_is_taken_at_the_next_flush_and_marks_of_one_flush_are_one() {
        let writes = ClientWrites::new();
        let mut delivery = Delivery::new(Some(writes.clone()));
        delivery.handed(Some(usage(1)));
        delivery.handed(Some(usage(2)));
        assert_eq!(delivery.untaken.len(), 1);
        delivery.asked();
        assert_eq!(delivery.newly_taken(), None, "asks say nothing here");
        writes.flushed();
        delivery.handed(Some(usage(3)));
        assert_eq!(delivery.newly_taken(), Some(usage(2)));
        assert!(!delivery.all_taken());
        writes.flushed();
        assert_eq!(delivery.newly_taken(), Some(usage(3)));
        assert!(delivery.all_taken());
    }

    #[test]
    fn a_frame_without_content_leaves_nothing_to_take() {
        let mut delivery = Delivery::new(None);
        delivery.handed(None);
        assert!(delivery.all_taken());
        assert_eq!(delivery.newly_taken(), None);
    }
}
