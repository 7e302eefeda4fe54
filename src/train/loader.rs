//! The data loader (what Petastorm does for PyTorch): per-epoch shuffling, length-grouped
//! batches with dynamic padding, sharding of each global batch across ranks, and a background thread that
//! builds the next batches while the model computes.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use tch::Tensor;

use super::data::Split;

/// A padded batch, ready for the model.
pub(crate) struct Batch {
    /// `[rows, longest]` int64, padded with the model's pad id.
    pub input_ids: Tensor,
    /// `[rows, longest]` int64, 1 for tokens and 0 for padding.
    pub attention_mask: Tensor,
    /// `[rows]` int64 class ids.
    pub labels: Tensor,
    pub rows: usize,
    /// Rows and real tokens of the global batch this is a part of (data parallelism); the
    /// batch's own otherwise.
    pub global_rows: usize,
    pub global_tokens: usize,
    /// Tensor slots (`rows * longest`) of the global batch, every rank's padded to its own
    /// longest row: against the real tokens, the padding cost.
    pub global_slots: usize,
}

/// A small, fast, seedable generator (SplitMix64); shuffles depend only on (seed, epoch),
/// so a resumed run replays exactly the same order.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64, stream: u64) -> Self {
        Self(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher-Yates.
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// How an epoch's batches are formed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Order {
    pub batch_size: usize,
    pub seed: u64,
    pub group_by_length: bool,
    pub rank: usize,
    pub world: usize,
}

/// Rows in a length group: groups this many batches, sorts them by length, then cuts them
/// into batches, so batches hold rows of similar length while every epoch still mixes.
const GROUP_BATCHES: usize = 64;

/// This rank's part of one global batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shard {
    pub rows: Vec<usize>,
    /// Rows, real tokens and padded slots of the whole global batch, every rank's part
    /// together.
    pub global_rows: usize,
    pub global_tokens: usize,
    pub global_slots: usize,
}

/// This rank's part of each global batch of `epoch`. Global batches (`batch_size * world`
/// rows) depend only on (seed, epoch) and the global batch size, never on the rank: rows
/// shuffled, grouped by length if asked, batch order shuffled again. Rank `r` takes the
/// `r`-th contiguous slice of each, so N ranks × batch B see exactly the batches one rank ×
/// batch N·B sees. Every row is used once per epoch: the last, short global batch is split
/// as evenly as it goes (sizes differ by at most one row, and a rank may get none when it
/// has fewer rows than there are ranks); each rank weighs its loss by its share.
pub(crate) fn epoch_batches(split: &Split, order: &Order, epoch: u64) -> Vec<Shard> {
    let global = order.batch_size * order.world;
    let mut rng = Rng::new(order.seed, epoch);
    let mut rows: Vec<usize> = (0..split.len()).collect();
    rng.shuffle(&mut rows);
    let mut batches: Vec<Vec<usize>> = if order.group_by_length {
        let mut out = Vec::new();
        for group in rows.chunks_mut(global * GROUP_BATCHES) {
            group.sort_by_key(|&r| std::cmp::Reverse(split.length(r)));
            out.extend(group.chunks(global).map(<[usize]>::to_vec));
        }
        rng.shuffle(&mut out);
        out
    } else {
        rows.chunks(global).map(<[usize]>::to_vec).collect()
    };
    batches
        .iter_mut()
        .map(|batch| {
            let (base, extra) = (batch.len() / order.world, batch.len() % order.world);
            let part = |rank: usize| {
                let start = rank * base + rank.min(extra);
                &batch[start..start + base + usize::from(rank < extra)]
            };
            let slots = |rows: &[usize]| {
                rows.len()
                    * rows
                        .iter()
                        .map(|&r| split.length(r))
                        .max()
                        .unwrap_or(0)
                        .max(1)
            };
            Shard {
                rows: part(order.rank).to_vec(),
                global_rows: batch.len(),
                global_tokens: batch.iter().map(|&r| split.length(r)).sum(),
                global_slots: (0..order.world).map(|r| slots(part(r))).sum(),
            }
        })
        .collect()
}

/// How many batches [`epoch_batches`] gives each rank, without shuffling anything: length
/// groups are whole multiples of the global batch size, so grouping never adds a batch.
pub(crate) fn batches_per_epoch(rows: usize, order: &Order) -> usize {
    rows.div_ceil(order.batch_size * order.world)
}

/// Batches for evaluation: every row once, sorted by length (least padding), in order.
pub(crate) fn eval_batches(split: &Split, batch_size: usize) -> Vec<Vec<usize>> {
    let mut rows: Vec<usize> = (0..split.len()).collect();
    rows.sort_by_key(|&r| split.length(r));
    rows.chunks(batch_size).map(<[usize]>::to_vec).collect()
}

/// Pads `rows` of `split` into a batch.
pub(crate) fn make_batch(split: &Split, rows: &[usize], pad_id: i64) -> Batch {
    let longest = rows
        .iter()
        .map(|&r| split.length(r))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut ids = vec![pad_id; rows.len() * longest];
    let mut mask = vec![0i64; rows.len() * longest];
    let mut tokens = 0;
    for (i, &r) in rows.iter().enumerate() {
        let row = split.row(r);
        tokens += row.len();
        for (j, t) in row.iter().enumerate() {
            ids[i * longest + j] = i64::from(*t);
            mask[i * longest + j] = 1;
        }
    }
    let shape = [rows.len() as i64, longest as i64];
    let labels: Vec<i64> = rows.iter().map(|&r| split.labels[r]).collect();
    Batch {
        input_ids: Tensor::from_slice(&ids).view(shape),
        attention_mask: Tensor::from_slice(&mask).view(shape),
        labels: Tensor::from_slice(&labels),
        rows: rows.len(),
        global_rows: rows.len(),
        global_tokens: tokens,
        global_slots: ids.len(),
    }
}

/// Builds batches on a background thread, `depth` ahead of the consumer.
pub(crate) struct Prefetch {
    rx: Receiver<Batch>,
    handle: Option<JoinHandle<()>>,
}

impl Prefetch {
    pub(crate) fn start(split: Arc<Split>, batches: Vec<Shard>, pad_id: i64, depth: usize) -> Self {
        let (tx, rx): (SyncSender<Batch>, _) = sync_channel(depth.max(1));
        let handle = std::thread::Builder::new()
            .name("lakeml-loader".into())
            .spawn(move || {
                for shard in batches {
                    let batch = Batch {
                        global_rows: shard.global_rows,
                        global_tokens: shard.global_tokens,
                        global_slots: shard.global_slots,
                        ..make_batch(&split, &shard.rows, pad_id)
                    };
                    // The consumer hung up (an error, or early stopping): stop quietly.
                    if tx.send(batch).is_err() {
                        return;
                    }
                }
            })
            .ok();
        Self { rx, handle }
    }
}

impl Iterator for Prefetch {
    type Item = Batch;
    fn next(&mut self) -> Option<Batch> {
        self.rx.recv().ok()
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        // Unblock the thread (its send fails once the receiver is gone), then reap it.
        let (_, dead) = sync_channel(0);
        drop(std::mem::replace(&mut self.rx, dead));
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(lengths: &[usize]) -> Split {
        let mut s = Split {
            offsets: vec![0],
            ..Split::default()
        };
        for (i, &n) in lengths.iter().enumerate() {
            s.tokens.extend(std::iter::repeat_n(7, n));
            s.offsets.push(s.tokens.len());
            s.labels.push((i % 2) as i64);
        }
        s
    }

    fn order(group_by_length: bool, rank: usize, world: usize) -> Order {
        Order {
            batch_size: 4,
            seed: 7,
            group_by_length,
            rank,
            world,
        }
    }

    #[test]
    fn every_row_once_per_epoch_and_epochs_differ() {
        let s = split(&(0..103).map(|i| 1 + i % 17).collect::<Vec<_>>());
        let e0 = epoch_batches(&s, &order(true, 0, 1), 0);
        let e1 = epoch_batches(&s, &order(true, 0, 1), 1);
        let mut all: Vec<usize> = e0.iter().flat_map(|b| b.rows.clone()).collect();
        all.sort();
        assert_eq!(all, (0..103).collect::<Vec<_>>());
        assert_ne!(e0, e1);
        assert_eq!(
            e0,
            epoch_batches(&s, &order(true, 0, 1), 0),
            "same seed, same order"
        );
        for (grouped, world) in [(true, 1), (false, 1), (true, 3), (false, 4)] {
            assert_eq!(
                batches_per_epoch(s.len(), &order(grouped, 0, world)),
                epoch_batches(&s, &order(grouped, 0, world), 0).len()
            );
        }
    }

    #[test]
    fn length_grouping_cuts_padding() {
        let s = split(&(0..512).map(|i| 1 + (i * 37) % 64).collect::<Vec<_>>());
        let pad = |batches: Vec<Shard>| -> usize {
            batches
                .iter()
                .map(|b| make_batch(&s, &b.rows, 0))
                .map(|b| b.global_slots - b.global_tokens)
                .sum()
        };
        let grouped = pad(epoch_batches(&s, &order(true, 0, 1), 0));
        let random = pad(epoch_batches(&s, &order(false, 0, 1), 0));
        assert!(grouped * 4 < random, "grouped {grouped} vs random {random}");
    }

    #[test]
    fn ranks_split_the_global_batches_of_one_process() {
        // 3 ranks × batch 4 see, step by step, the batches one rank × batch 12 sees; the
        // last global batch (103 = 8·12 + 7 rows) splits 3, 2, 2.
        let s = split(&(0..103).map(|i| 1 + (i * 7) % 23).collect::<Vec<_>>());
        for grouped in [true, false] {
            let one = epoch_batches(
                &s,
                &Order {
                    batch_size: 12,
                    ..order(grouped, 0, 1)
                },
                2,
            );
            let shards: Vec<_> = (0..3)
                .map(|r| epoch_batches(&s, &order(grouped, r, 3), 2))
                .collect();
            assert!(shards.iter().all(|b| b.len() == one.len()));
            for (step, whole) in one.iter().enumerate() {
                let joined: Vec<usize> = shards.iter().flat_map(|b| b[step].rows.clone()).collect();
                assert_eq!(joined, whole.rows, "step {step}");
                assert!(
                    shards
                        .iter()
                        .all(|b| b[step].global_rows == whole.rows.len())
                );
                assert!(
                    shards
                        .iter()
                        .all(|b| b[step].global_tokens == whole.global_tokens)
                );
                let slots: usize = shards
                    .iter()
                    .map(|b| make_batch(&s, &b[step].rows, 0).global_slots)
                    .sum();
                assert!(shards.iter().all(|b| b[step].global_slots == slots));
            }
            // Batch order is shuffled: the short batch may be any step.
            let short = one.iter().position(|b| b.rows.len() == 7);
            let split: Vec<Option<usize>> = shards
                .iter()
                .map(|b| short.map(|i| b[i].rows.len()))
                .collect();
            assert_eq!(split, [Some(3), Some(2), Some(2)]);
        }
    }

    #[test]
    fn batches_pad_to_the_longest_row_with_the_pad_id() {
        let s = split(&[2, 4, 1]);
        let b = make_batch(&s, &[0, 1, 2], 9);
        assert_eq!(b.input_ids.size(), vec![3, 4]);
        assert_eq!(
            Vec::<i64>::try_from(b.input_ids.view([-1])).unwrap_or_default(),
            vec![7, 7, 9, 9, 7, 7, 7, 7, 7, 9, 9, 9]
        );
        assert_eq!(
            Vec::<i64>::try_from(b.attention_mask.sum(tch::Kind::Int64).view([1]))
                .unwrap_or_default(),
            vec![7]
        );
        assert_eq!((b.global_tokens, b.global_slots), (7, 12));
    }

    #[test]
    fn prefetch_yields_batches_in_order_and_stops_when_dropped() {
        let s = Arc::new(split(&[1; 40]));
        let batches: Vec<Shard> = eval_batches(&s, 4)
            .into_iter()
            .map(|rows| Shard {
                global_rows: rows.len(),
                global_tokens: rows.len(),
                global_slots: rows.len(),
                rows,
            })
            .collect();
        let mut p = Prefetch::start(s.clone(), batches.clone(), 0, 2);
        assert_eq!(p.next().map(|b| b.rows), Some(4));
        drop(p); // must not hang with the thread blocked on a full channel
        assert_eq!(Prefetch::start(s, batches, 0, 2).count(), 10);
    }
}
