//! The in-memory store's call log: records in fixed-size chunks, so that the log grows without
//! moving what it holds. (A `Vec` of every record copies all of them each time it outgrows
//! its buffer, under the store's lock: at a million calls, hundreds of megabytes at once.)

use crate::store::types::CallRecord;

/// Records per chunk (a chunk is allocated whole, about a megabyte).
const CHUNK: usize = 4096;

/// Call records, the first at index 0, appended only.
#[derive(Debug, Default)]
pub(super) struct CallLog {
    chunks: Vec<Vec<CallRecord>>,
    len: usize,
}

impl CallLog {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn push(&mut self, record: CallRecord) {
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK => chunk.push(record),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(record);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
    }

    pub(super) fn get(&self, index: usize) -> Option<&CallRecord> {
        self.chunks.get(index / CHUNK)?.get(index % CHUNK)
    }

    pub(super) fn get_mut(&mut self, index: usize) -> Option<&mut CallRecord> {
        self.chunks.get_mut(index / CHUNK)?.get_mut(index % CHUNK)
    }

    /// The records in the order they were appended (`.rev()` for the newest first).
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = &CallRecord> {
        self.chunks.iter().flatten()
    }
}

impl<'a> IntoIterator for &'a CallLog {
    type Item = &'a CallRecord;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Vec<CallRecord>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.chunks.iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::{AccountId, CallId, KeyId};
    use crate::credits::Credits;
    use crate::store::types::CallStatus;

    fn record(id: i64) -> CallRecord {
        CallRecord {
            id: CallId(id),
            account: AccountId(1),
            key: KeyId(1),
            protocol: crate::Protocol::ChatCompletions,
            model: "m".into(),
            requested_model: None,
            price: Credits::ZERO,
            charged_subscription: Credits::ZERO,
            charged_topup: Credits::ZERO,
            status: CallStatus::Pending,
            upstream_status: None,
            channel: None,
            upstream_error: None,
            input_tokens: None,
            output_tokens: None,
            cache_read_tokens: None,
            cache_write_tokens: None,
            cache_write_1h_tokens: None,
            reasoning_tokens: None,
            shortfall: Credits::ZERO,
            created_at: chrono::Utc::now(),
            finished_at: None,
            request_id: None,
        }
    }

    #[test]
    fn records_across_chunks_are_found_by_index_and_iterated_in_order_both_ways() {
        let mut log = CallLog::default();
        let count = 2 * CHUNK + 3;
        for id in 1..=count {
            log.push(record(i64::try_from(id).unwrap()));
        }
        assert_eq!(log.len(), count);
        for index in [0, CHUNK - 1, CHUNK, 2 * CHUNK, count - 1] {
            assert_eq!(
                log.get(index).unwrap().id.0,
                i64::try_from(index + 1).unwrap()
            );
        }
        assert!(log.get(count).is_none());
        log.get_mut(CHUNK).unwrap().status = CallStatus::Ok;
        assert_eq!(log.get(CHUNK).unwrap().status, CallStatus::Ok);
        let ids: Vec<i64> = log.iter().map(|record| record.id.0).collect();
        assert_eq!(ids, (1..=i64::try_from(count).unwrap()).collect::<Vec<_>>());
        let newest: Vec<i64> = log.iter().rev().take(4).map(|record| record.id.0).collect();
        let last = i64::try_from(count).unwrap();
        assert_eq!(newest, vec![last, last - 1, last - 2, last - 3]);
        assert_eq!((&log).into_iter().count(), count);
    }
}
