//! The in-memory store's call log: records in fixed-size chunks, so that the log grows without
//! moving what it holds. (A `Vec` of every record copies all of them each time it outgrows
//! its buffer, under the store's lock: at a million calls, hundreds of megabytes at once.)

use crate::store::types::CallRecord;

/// Records per chunk (a chunk is allocated whole, about a megabyte).
const CHUNK: usize = 4096;

/// Call records, the first at index 0, appended only.
pub(super) type CallLog = Chunked<CallRecord>;

/// Items in chunks of [`CHUNK`], appended only.
#[derive(Debug)]
pub(super) struct Chunked<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Chunked {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Chunked<T> {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn push(&mut self, record: T) {
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

    pub(super) fn get(&self, index: usize) -> Option<&T> {
        self.chunks.get(index / CHUNK)?.get(index % CHUNK)
    }

    pub(super) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        self.chunks.get_mut(index / CHUNK)?.get_mut(index % CHUNK)
    }

    /// The items in the order they were appended (`.rev()` for the newest first).
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

impl<'a, T> IntoIterator for &'a Chunked<T> {
    type Item = &'a T;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Vec<T>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.chunks.iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_across_chunks_are_found_by_index_and_iterated_in_order_both_ways() {
        let mut log = Chunked::default();
        let count = 2 * CHUNK + 3;
        for id in 1..=count {
            log.push(id);
        }
        assert_eq!(log.len(), count);
        for index in [0, CHUNK - 1, CHUNK, 2 * CHUNK, count - 1] {
            assert_eq!(log.get(index), Some(&(index + 1)));
        }
        assert!(log.get(count).is_none());
        *log.get_mut(CHUNK).unwrap() = 0;
        assert_eq!(log.get(CHUNK), Some(&0));
        let ids: Vec<usize> = log.iter().copied().collect();
        let mut expected: Vec<usize> = (1..=count).collect();
        expected[CHUNK] = 0;
        assert_eq!(ids, expected);
        let newest: Vec<usize> = log.iter().rev().take(4).copied().collect();
        assert_eq!(newest, vec![count, count - 1, count - 2, count - 3]);
        assert_eq!((&log).into_iter().count(), count);
    }
}
