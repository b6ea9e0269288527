//! `PYTORCH_CUDA_ALLOC_CONF` as PyTorch 2.13 parses it (`AcceleratorAllocatorConfig::parseArgs`
//! in c10/core/AllocatorConfig.cpp, then `CUDAAllocatorConfig::parseArgs` for the CUDA keys),
//! into the settings the simulation uses. Keys that do not change device memory accounting
//! (the pinned host allocator's, `release_lock_on_cudamalloc`, …) are checked as PyTorch checks
//! them and otherwise ignored; `backend:cudaMallocAsync` is refused, it is another allocator.

use super::constants::{K_LARGE_BUFFER, K_MIN_LARGE_ALLOC};

const MIB: u64 = 1 << 20;
/// `kRoundUpPowerOfTwoIntervals`: `roundup_power2_divisions` has one entry per power-of-two
/// interval of sizes, [1 MiB, 2 MiB) … [32 GiB, 64 GiB), the first also covering smaller sizes
/// and the last larger ones.
pub const ROUNDUP_INTERVALS: usize = 16;

/// Every key PyTorch 2.13's parsers accept (`AcceleratorAllocatorConfig::getKeys` and
/// `CUDAAllocatorConfig::getKeys`), for the unknown-key error.
const KNOWN_KEYS: &str = "large_segment_size_mb, max_split_size_mb, max_non_split_rounding_mb, \
     garbage_collection_threshold, roundup_power2_divisions, expandable_segments, \
     per_process_memory_fraction, throw_on_cudamalloc_oom, backend, release_lock_on_cudamalloc, \
     graph_capture_record_stream_reuse, pinned_use_cuda_host_register, pinned_num_register_threads, \
     pinned_reserve_segment_size_mb, pinned_free_catch_all, pinned_use_background_threads, \
     pinned_max_round_threshold_mb, pinned_max_cached_size_mb";

/// The device allocator's settings. `Default` is PyTorch's with `PYTORCH_CUDA_ALLOC_CONF` unset.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocatorConfig {
    /// `max_split_size_mb` in bytes: blocks this large are never split (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes: how much larger than a request of at least
    /// `max_split_size` a cached block may be and still serve it.
    pub max_non_split_rounding_size: u64,
    /// `large_segment_size_mb` in bytes: the segment shared by requests of 1 to 10 MiB, and the
    /// page of the large pool's expandable segments.
    pub large_segment_size: u64,
    /// `roundup_power2_divisions` per size interval (see [`ROUNDUP_INTERVALS`]); 0 or 1: none.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `garbage_collection_threshold`; 0: off. PyTorch collects only under a memory fraction
    /// (`per_process_memory_fraction` below 1), and so does the simulation.
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `per_process_memory_fraction`: the share of the device this process may reserve.
    pub per_process_memory_fraction: f64,
    /// `throw_on_cudamalloc_oom`: reject a request that would pass the fraction's limit at once,
    /// without releasing cached blocks and retrying.
    pub throw_on_cudamalloc_oom: bool,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding_size: K_LARGE_BUFFER,
            large_segment_size: K_LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            per_process_memory_fraction: 1.0,
            throw_on_cudamalloc_oom: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("parsing allocator config {conf:?}: {problem}")]
    Syntax { conf: String, problem: String },
    #[error("allocator config: unrecognized key {key:?}; PyTorch 2.13 knows {KNOWN_KEYS}")]
    UnknownKey { key: String },
    #[error("allocator config {key}:{value}: {reason}")]
    BadValue { key: String, value: String, reason: String },
    #[error("allocator config {key}:{value} is not simulated: {reason}")]
    NotSimulated {
        key: String,
        value: String,
        reason: &'static str,
    },
    #[error(
        "allocator config {key} needs the device's capacity (the limit is a share of it); \
         give one (--capacity, or capacity_bytes in the trace)"
    )]
    NeedsCapacity { key: &'static str },
}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string (`"max_split_size_mb:128,expandable_segments:True"`,
    /// `"roundup_power2_divisions:[256:1,512:2,>:8]"`); the empty string gives the defaults.
    pub fn parse(conf: &str) -> Result<Self, ConfigError> {
        let entries = entries(conf)?;
        let mut config = AllocatorConfig::default();
        // AcceleratorAllocatorConfig::parseArgs reads large_segment_size_mb first, wherever it
        // stands: the lower bounds of max_split_size_mb and max_non_split_rounding_mb are it.
        for e in entries.iter().filter(|e| e.key == "large_segment_size_mb") {
            config.large_segment_size = mebibytes(e, K_MIN_LARGE_ALLOC / MIB + 1)?;
        }
        config.max_non_split_rounding_size = config.large_segment_size;
        for e in &entries {
            config.apply(e)?;
        }
        Ok(config)
    }

    /// `AcceleratorAllocatorConfig::roundup_power2_divisions(size)`: the divisions of the
    /// interval holding `size` (index log2(size) − 20, clamped to the table).
    pub fn roundup_power2_divisions_for(&self, size: u64) -> u64 {
        let log_size = 63 - size.max(1).leading_zeros() as usize;
        self.roundup_power2_divisions[log_size.saturating_sub(20).min(ROUNDUP_INTERVALS - 1)]
    }

    fn apply(&mut self, e: &Entry) -> Result<(), ConfigError> {
        let min_mb = self.large_segment_size / MIB;
        match e.key.as_str() {
            "large_segment_size_mb" => {} // read first, above
            "max_split_size_mb" => self.max_split_size = mebibytes(e, min_mb)?,
            "max_non_split_rounding_mb" => self.max_non_split_rounding_size = mebibytes(e, min_mb)?,
            "garbage_collection_threshold" => {
                self.garbage_collection_threshold = fraction(e, |v| v > 0.0 && v < 1.0, "in (0.0, 1.0)")?
            }
            "per_process_memory_fraction" => {
                self.per_process_memory_fraction = fraction(e, |v| (0.0..=1.0).contains(&v), "in [0.0, 1.0]")?
            }
            "roundup_power2_divisions" => self.roundup_power2_divisions = divisions(e)?,
            "expandable_segments" => self.expandable_segments = boolean(e)?,
            "throw_on_cudamalloc_oom" => self.throw_on_cudamalloc_oom = boolean(e)?,
            "backend" => backend(e)?,
            _ => check_ignored(e)?,
        }
        Ok(())
    }
}

/// Keys PyTorch accepts that change nothing the simulation counts: checked, then dropped.
fn check_ignored(e: &Entry) -> Result<(), ConfigError> {
    match e.key.as_str() {
        "release_lock_on_cudamalloc"
        | "release_lock_on_hipmalloc"
        | "pinned_use_cuda_host_register"
        | "pinned_use_hip_host_register"
        | "graph_capture_record_stream_reuse"
        | "pinned_free_catch_all"
        | "pinned_use_background_threads" => boolean(e).map(drop),
        "pinned_reserve_segment_size_mb" | "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" => {
            whole(e).map(drop)
        }
        "pinned_num_register_threads" => {
            // CUDAAllocatorConfig::parsePinnedNumRegisterThreads.
            let n = whole(e)?;
            if !n.is_power_of_two() || n > 128 {
                return Err(bad(
                    e,
                    "the number of register threads must be a power of 2, at most 128",
                ));
            }
            Ok(())
        }
        _ => Err(ConfigError::UnknownKey { key: e.key.clone() }),
    }
}

/// `CUDAAllocatorConfig::parseAllocatorConfig`.
fn backend(e: &Entry) -> Result<(), ConfigError> {
    match scalar(e)? {
        "native" => Ok(()),
        "cudaMallocAsync" => Err(ConfigError::NotSimulated {
            key: e.key.clone(),
            value: e.value.to_string(),
            reason: "cudaMallocAsync is CUDA's own stream-ordered allocator, not the caching allocator",
        }),
        _ => Err(bad(
            e,
            "unknown allocator backend, options are native and cudaMallocAsync",
        )),
    }
}

/// `parseMaxSplitSize` and its kin: a whole number of MiB, at least `min_mb`, capped where
/// bytes would overflow.
fn mebibytes(e: &Entry, min_mb: u64) -> Result<u64, ConfigError> {
    let mb = whole(e)?;
    if mb < min_mb {
        return Err(bad(e, &format!("too small, must be >= {min_mb}")));
    }
    Ok(mb.min(u64::MAX / MIB) * MIB)
}

fn fraction(e: &Entry, ok: impl Fn(f64) -> bool, range: &str) -> Result<f64, ConfigError> {
    let v: f64 = scalar(e)?.parse().map_err(|_| bad(e, "not a number"))?;
    if !ok(v) {
        return Err(bad(e, &format!("must be {range}")));
    }
    Ok(v)
}

/// `ConfigTokenizer::toBool`: exactly `True` or `False`.
fn boolean(e: &Entry) -> Result<bool, ConfigError> {
    match scalar(e)? {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(bad(e, "expected True or False")),
    }
}

fn whole(e: &Entry) -> Result<u64, ConfigError> {
    parse_whole(scalar(e)?).ok_or_else(|| bad(e, "not a whole number"))
}

/// `ConfigTokenizer::toSizeT` is `std::stoull`, which would also read `12abc` as 12 and `-1`
/// as 2^64 − 1; those are refused here rather than guessed at.
fn parse_whole(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `parseRoundUpPower2Divisions`: one power of two for every interval, or a list of
/// `interval_mb:divisions` where each interval is a power of two (in MiB) and `>` stands for
/// every interval after the last one named; the first one named also covers those below it.
fn divisions(e: &Entry) -> Result<[u64; ROUNDUP_INTERVALS], ConfigError> {
    let mut table = [0; ROUNDUP_INTERVALS];
    let items = match &e.value {
        Value::Scalar(s) => {
            let d = parse_whole(s).filter(|d| d.is_power_of_two());
            let d = d.ok_or_else(|| bad(e, "the divisions have to be a power of 2"))?;
            return Ok([d; ROUNDUP_INTERVALS]);
        }
        Value::List(items) => items,
    };
    let mut first = true;
    let mut last_index = 0;
    for (interval, value) in items {
        let d = parse_whole(value).filter(|d| *d == 0 || d.is_power_of_two());
        let d = d.ok_or_else(|| bad(e, &format!("divisions {value:?} are not a power of 2 or 0")))?;
        if interval == ">" {
            table.iter_mut().skip(last_index + 1).for_each(|t| *t = d);
            continue;
        }
        let mb = parse_whole(interval).filter(|m| m.is_power_of_two());
        let mb = mb.ok_or_else(|| bad(e, &format!("interval {interval:?} is not a power of 2")))?;
        let index = (63 - mb.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        if first {
            table[..index].iter_mut().for_each(|t| *t = d);
            first = false;
        }
        table[index] = d;
        last_index = index;
    }
    Ok(table)
}

fn scalar(e: &Entry) -> Result<&str, ConfigError> {
    match &e.value {
        Value::Scalar(s) => Ok(s),
        Value::List(_) => Err(bad(e, "expected a single value, not a list")),
    }
}

fn bad(e: &Entry, reason: &str) -> ConfigError {
    ConfigError::BadValue {
        key: e.key.clone(),
        value: e.value.to_string(),
        reason: reason.to_string(),
    }
}

/// One `key:value` or `key:[a:b,c:d]` of the string.
#[derive(Debug)]
struct Entry {
    key: String,
    value: Value,
}

#[derive(Debug)]
enum Value {
    Scalar(String),
    List(Vec<(String, String)>),
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Scalar(s) => f.write_str(s),
            Value::List(items) => {
                let inner: Vec<String> = items.iter().map(|(a, b)| format!("{a}:{b}")).collect();
                write!(f, "[{}]", inner.join(","))
            }
        }
    }
}

/// `ConfigTokenizer`: `,` `:` `[` `]` are tokens of their own, whitespace is dropped, the rest
/// runs together into words.
fn tokenize(conf: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    for ch in conf.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                tokens.push(std::mem::take(&mut word));
            }
            tokens.push(ch.to_string());
        } else if !(ch.is_ascii_whitespace() || ch == '\x0b') {
            word.push(ch);
        }
    }
    if !word.is_empty() {
        tokens.push(word);
    }
    tokens
}

/// The entries in order, with the grammar PyTorch's parsers enforce: `key:value` pairs
/// separated by commas (a trailing comma allowed), a value being a word or a bracketed list
/// of `word:word`.
fn entries(conf: &str) -> Result<Vec<Entry>, ConfigError> {
    let mut cursor = Cursor {
        conf,
        tokens: tokenize(conf),
        at: 0,
    };
    let mut out = Vec::new();
    while cursor.peek().is_some() {
        let key = cursor.word("a key")?;
        cursor.expect(":", &key)?;
        let value = if cursor.peek() == Some("[") {
            cursor.at += 1;
            Value::List(cursor.list(&key)?)
        } else {
            Value::Scalar(cursor.word(&format!("a value for {key}"))?)
        };
        out.push(Entry { key, value });
        if cursor.peek().is_some() {
            cursor.expect(",", "a value")?;
        }
    }
    Ok(out)
}

struct Cursor<'a> {
    conf: &'a str,
    tokens: Vec<String>,
    at: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.at).map(String::as_str)
    }

    fn error(&self, problem: String) -> ConfigError {
        ConfigError::Syntax {
            conf: self.conf.to_string(),
            problem,
        }
    }

    fn found(&self) -> String {
        self.peek().map_or("the end".to_string(), |t| format!("{t:?}"))
    }

    fn word(&mut self, what: &str) -> Result<String, ConfigError> {
        match self.peek().map(str::to_string) {
            Some(t) if !matches!(t.as_str(), "," | ":" | "[" | "]") => {
                self.at += 1;
                Ok(t)
            }
            _ => Err(self.error(format!("expected {what}, found {}", self.found()))),
        }
    }

    fn expect(&mut self, token: &str, after: &str) -> Result<(), ConfigError> {
        if self.peek() == Some(token) {
            self.at += 1;
            return Ok(());
        }
        Err(self.error(format!("expected {token:?} after {after}, found {}", self.found())))
    }

    /// The items of a list whose `[` was read, through its `]`.
    fn list(&mut self, key: &str) -> Result<Vec<(String, String)>, ConfigError> {
        let mut items = Vec::new();
        while self.peek() != Some("]") {
            let a = self.word(&format!("an item of {key}'s list or ']'"))?;
            self.expect(":", &a)?;
            let b = self.word(&format!("a value for {a} in {key}'s list"))?;
            items.push((a, b));
            if self.peek() != Some("]") {
                self.expect(",", "a list item")?;
            }
        }
        self.at += 1;
        Ok(items)
    }
}
