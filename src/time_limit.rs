//! Time limits that cost nothing when the answer is already there.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use tokio::time::error::Elapsed;

/// `future`'s output, or [`Elapsed`] if it takes longer than `limit`: as
/// [`tokio::time::timeout`], except that a future ready at its first poll (an in-memory store's
/// answer, a reservation an owned file decides at once, the mock upstream's reply) is answered
/// without reading the clock or making a timer. Otherwise the limit runs from that first poll.
pub(crate) async fn within<F: Future>(limit: Duration, future: F) -> Result<F::Output, Elapsed> {
    let mut future = pin!(future);
    if let Poll::Ready(output) = poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await {
        return Ok(output);
    }
    tokio::time::timeout(limit, future).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_ready_answer_is_taken_and_a_late_one_times_out() {
        assert_eq!(within(Duration::ZERO, async { 7 }).await.ok(), Some(7));
        let late = within(Duration::from_secs(1), async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            7
        });
        assert!(late.await.is_err(), "past its limit");
        let in_time = within(Duration::from_secs(2), async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            7
        });
        assert_eq!(in_time.await.ok(), Some(7));
    }
}
