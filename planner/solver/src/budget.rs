//! Memory sizes as people write them (`12GiB`, `12G`, `12000MB`, `123456`) and as the
//! planner prints them back.
//!
//! Convention: `KiB/MiB/GiB/TiB/PiB/EiB` and the bare letters `K/M/G/T/P/E` are 1024-based, as in
//! PyTorch's memory summaries and nvidia-smi; `KB/MB/GB/TB/PB/EB` are 1000-based, as in SI;
//! `B` or no unit means bytes. Units are case-insensitive. Fractions are allowed
//! (`1.5TiB`) and any fraction of a byte left over is dropped, so a parsed budget never
//! exceeds what was written.

/// The forms [`parse_size`] accepts, for error and help text.
pub const SIZE_FORMS: &str = "a byte count (123456) or a number with a unit: \
     KiB/MiB/GiB/TiB/PiB/EiB or K/M/G/T/P/E (1024-based), KB/MB/GB/TB/PB/EB \
     (1000-based), B; \
     case-insensitive, e.g. 12GiB, 12G, 12000MB, 1.5TiB";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("parsing size {input:?}: {reason}; expected {SIZE_FORMS}")]
    Invalid { input: String, reason: &'static str },
    #[error("parsing size {input:?}: unknown unit {unit:?}; expected {SIZE_FORMS}")]
    UnknownUnit { input: String, unit: String },
    #[error("parsing size {input:?}: more than 2^64 − 1 bytes")]
    Overflow { input: String },
    #[error(
        "parsing budget {input:?}: {reason}; a relative budget is a percentage from 0 (the smallest \
         peak checkpointing reaches) to 100 (the unconstrained peak), e.g. 80%"
    )]
    Percent { input: String, reason: &'static str },
}

/// A memory budget as written: a size, or a share of what checkpointing can save.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    Bytes(u64),
    /// `80%`: the budget lies that share of the way from the smallest peak checkpointing
    /// reaches (0%) to the unconstrained peak (100%), for the config the unconstrained plan
    /// runs. `torch._functorch.config.activation_memory_budget` is normalized the same way,
    /// between recomputing everything and saving everything, so any share below 100% makes a
    /// plan checkpoint something and any share is achievable. Resolved once the profile is
    /// known, by [`Budget::resolve`].
    Percent(f64),
}

impl Budget {
    /// The budget in bytes, given the smallest and the unconstrained peak (bytes) a share is
    /// taken between; a share rounds down, so a resolved budget never exceeds what was asked.
    pub fn resolve(self, smallest_peak: i64, unconstrained_peak: i64) -> i64 {
        match self {
            Budget::Bytes(b) => i64::try_from(b).unwrap_or(i64::MAX),
            Budget::Percent(p) => {
                let span = (unconstrained_peak - smallest_peak).max(0) as f64;
                smallest_peak + (span * p / 100.0).floor() as i64
            }
        }
    }
}

/// Parse a budget: a size ([`parse_size`]) or a percentage (`80%`, `62.5 %`).
pub fn parse_budget(s: &str) -> Result<Budget, SizeError> {
    let Some(number) = s.trim().strip_suffix('%') else {
        return parse_size(s).map(Budget::Bytes);
    };
    let invalid = |reason| SizeError::Percent {
        input: s.to_string(),
        reason,
    };
    let p: f64 = number
        .trim()
        .parse()
        .map_err(|_| invalid("it is not a number followed by %"))?;
    if !(0.0..=100.0).contains(&p) {
        return Err(invalid("it is outside 0% to 100%"));
    }
    Ok(Budget::Percent(p))
}

/// Unit spellings (lower-case) and their sizes in bytes.
const UNITS: &[(&str, u64)] = &[
    ("", 1),
    ("b", 1),
    ("k", 1 << 10),
    ("kib", 1 << 10),
    ("kb", 1_000),
    ("m", 1 << 20),
    ("mib", 1 << 20),
    ("mb", 1_000_000),
    ("g", 1 << 30),
    ("gib", 1 << 30),
    ("gb", 1_000_000_000),
    ("t", 1 << 40),
    ("tib", 1 << 40),
    ("tb", 1_000_000_000_000),
    ("p", 1 << 50),
    ("pib", 1 << 50),
    ("pb", 1_000_000_000_000_000),
    ("e", 1 << 60),
    ("eib", 1 << 60),
    ("eb", 1_000_000_000_000_000_000),
];

/// Parse a size in bytes; see the module docs for the accepted forms.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let invalid = |reason| SizeError::Invalid {
        input: s.to_string(),
        reason,
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(invalid("it is empty"));
    }
    if t.starts_with('-') {
        return Err(invalid("a size cannot be negative"));
    }
    let t = t.strip_prefix('+').unwrap_or(t);
    let num_end = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(num_end);
    let unit = unit.trim_start();
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() {
        return Err(invalid("it does not start with a number"));
    }
    if frac.contains('.') {
        return Err(invalid("the number has more than one decimal point"));
    }
    let unit_lc = unit.to_ascii_lowercase();
    let Some(&(_, mult)) = UNITS.iter().find(|(u, _)| *u == unit_lc) else {
        return Err(SizeError::UnknownUnit {
            input: s.to_string(),
            unit: unit.to_string(),
        });
    };
    let overflow = || SizeError::Overflow { input: s.to_string() };
    // Exact decimal arithmetic in u128: int·mult + ⌊frac·mult / 10^digits⌋.
    let mut bytes: u128 = 0;
    for d in int.bytes() {
        bytes = bytes
            .checked_mul(10)
            .and_then(|b| b.checked_add(u128::from(d - b'0')))
            .filter(|&b| b <= u128::from(u64::MAX))
            .ok_or_else(overflow)?;
    }
    bytes = bytes.checked_mul(u128::from(mult)).ok_or_else(overflow)?;
    // 18 digits keep num·mult below 10^18 · 2^60 < 2^120: exact in u128.
    if frac.len() > 18 {
        return Err(invalid("the number has more than 18 decimal digits"));
    }
    let mut num: u128 = 0;
    let mut den: u128 = 1;
    for d in frac.bytes() {
        num = num * 10 + u128::from(d - b'0');
        den *= 10;
    }
    bytes += num * u128::from(mult) / den;
    u64::try_from(bytes).map_err(|_| overflow())
}

/// `512 B`, `1.50 KiB`, `11.50 GiB`: 1024-based units with two decimals, which
/// [`parse_size`] reads back to within 0.5 %.
pub fn format_size(bytes: u64) -> String {
    const NAMES: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut k = 0;
    // Move up when two decimals would print 1024.00.
    while v >= 1023.995 && k + 1 < NAMES.len() {
        v /= 1024.0;
        k += 1;
    }
    format!("{v:.2} {}", NAMES[k])
}
