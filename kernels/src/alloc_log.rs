//! The meter's allocation log: every allocation and free the counting allocators count (CPU
//! tensors, oneDNN's raw buffers, meta storages in fake mode), in the order the counters saw
//! them, with their bytes: a training step's allocation trace, which the CUDA caching
//! allocator's simulation replays without a GPU.
//!
//! Recording costs nothing while it is off (the counting allocators test one flag); while it
//! is on, each event is appended under a lock. The log is process-wide, like the meter: hold
//! [`crate::meter::exclusive`] around a recording.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::{ffi, KernelError};

static RECORDING: AtomicBool = AtomicBool::new(false);

/// One event of a recorded trace. Ids number allocations from 0 in the order they were made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocEvent {
    Alloc {
        id: u64,
        bytes: u64,
    },
    Free {
        id: u64,
    },
    /// A named moment starts (from [`Recording::mark`]).
    Mark(String),
}

/// A finished recording.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocLog {
    pub events: Vec<AllocEvent>,
    /// Bytes freed during the recording that were allocated before it started (not in
    /// `events`: their allocations are not either).
    pub freed_from_before: u64,
}

impl AllocLog {
    /// The recorded bytes live after each event (marks included), counted from the start.
    pub fn levels(&self) -> Vec<i64> {
        let mut live: HashMap<u64, u64> = HashMap::new();
        let mut now = 0i64;
        let mut out = Vec::with_capacity(self.events.len());
        for e in &self.events {
            match e {
                AllocEvent::Alloc { id, bytes } => {
                    live.insert(*id, *bytes);
                    now += *bytes as i64;
                }
                AllocEvent::Free { id } => now -= live.remove(id).unwrap_or(0) as i64,
                AllocEvent::Mark(_) => {}
            }
            out.push(now);
        }
        out
    }

    /// The index of the first mark named `name`.
    pub fn mark(&self, name: &str) -> Option<usize> {
        self.events
            .iter()
            .position(|e| matches!(e, AllocEvent::Mark(m) if m == name))
    }
}

/// Each allocation and free of `events` with its bytes, named as PyTorch's allocator history
/// names them (`"alloc"`, `"free_completed"`), to compare a trace with a GPU's. Empty storages
/// are left out: the caching allocator hands out no block for 0 bytes (and the meta device's
/// `where` makes one before it resizes it).
pub fn history(events: &[AllocEvent]) -> Vec<(&'static str, u64)> {
    let mut sizes = HashMap::new();
    events
        .iter()
        .filter_map(|e| match e {
            AllocEvent::Alloc { id, bytes } => {
                sizes.insert(*id, *bytes);
                Some(("alloc", *bytes))
            }
            AllocEvent::Free { id } => Some(("free_completed", sizes.get(id).copied().unwrap_or(0))),
            AllocEvent::Mark(_) => None,
        })
        .filter(|(_, bytes)| *bytes > 0)
        .collect()
}

/// An allocation log being recorded; stops when finished or dropped.
#[derive(Debug)]
pub struct Recording {
    marks: Vec<(i64, String)>,
    done: bool,
}

impl Recording {
    /// Starts recording (the meters need not be installed yet: what they count from their
    /// installation on is recorded). One recording at a time per process.
    pub fn start() -> Result<Recording, KernelError> {
        if RECORDING.swap(true, Ordering::SeqCst) {
            return Err(KernelError::Invalid {
                op: "recording allocations",
                message: "another recording is running in this process".into(),
            });
        }
        unsafe { ffi::ckpt_meter_log_start() };
        Ok(Recording {
            marks: Vec::new(),
            done: false,
        })
    }

    /// Marks where a named moment starts: between the events recorded so far and the next.
    pub fn mark(&mut self, name: impl Into<String>) {
        let at = unsafe { ffi::ckpt_meter_log_len() };
        self.marks.push((at, name.into()));
    }

    /// Stops recording and returns the log: each free paired with the allocation of its key
    /// made earliest among those still live (a key is reused once freed; a resized meta
    /// storage logs its new bytes before freeing the old under one key).
    pub fn finish(mut self) -> AllocLog {
        self.stop();
        let raw = read_raw();
        let mut marks = std::mem::take(&mut self.marks).into_iter().peekable();
        let mut live: HashMap<u64, VecDeque<(u64, u64)>> = HashMap::new();
        let mut log = AllocLog::default();
        let mut next_id = 0u64;
        for (i, (bytes, key)) in raw.into_iter().enumerate() {
            while let Some((_, name)) = marks.next_if(|(at, _)| *at <= i as i64) {
                log.events.push(AllocEvent::Mark(name));
            }
            if bytes >= 0 {
                live.entry(key).or_default().push_back((next_id, bytes as u64));
                log.events.push(AllocEvent::Alloc {
                    id: next_id,
                    bytes: bytes as u64,
                });
                next_id += 1;
            } else {
                match live.get_mut(&key).and_then(VecDeque::pop_front) {
                    Some((id, _)) => log.events.push(AllocEvent::Free { id }),
                    None => log.freed_from_before += (!bytes) as u64,
                }
            }
        }
        log.events.extend(marks.map(|(_, name)| AllocEvent::Mark(name)));
        log
    }

    fn stop(&mut self) {
        if !self.done {
            unsafe { ffi::ckpt_meter_log_stop() };
            self.done = true;
            RECORDING.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The raw log: (bytes, key), a free's bytes as `!bytes`.
fn read_raw() -> Vec<(i64, u64)> {
    let len = unsafe { ffi::ckpt_meter_log_len() }.max(0) as usize;
    let mut bytes = vec![0i64; len];
    let mut keys = vec![0u64; len];
    let n = unsafe { ffi::ckpt_meter_log_read(0, len as i64, bytes.as_mut_ptr(), keys.as_mut_ptr()) };
    bytes.truncate(n.max(0) as usize);
    bytes.into_iter().zip(keys).collect()
}
