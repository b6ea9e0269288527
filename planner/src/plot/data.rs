//! What a plot is drawn from: plain structs (what a figure is about, trade-off points,
//! candidate bars) and the labels of checkpoint subsets.

/// What a figure is about; shown in its title.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotMeta {
    pub model: String,
    pub micro_batch: i64,
    pub grad_accum: i64,
    /// Gradients freed after each optimizer step (PyTorch's `zero_grad(set_to_none=True)`).
    pub set_to_none: bool,
    pub precision: String,
    pub optimizer: String,
    /// The device as the reader should see it, e.g. `cpu (2 threads)`.
    pub device: String,
    /// Where the numbers come from, e.g. `measured: median of 3 steps per subset`.
    pub source: String,
}

impl PlotMeta {
    /// `<model>-<precision>-<optimizer>-mb<N>`, plus `-ga<K>` for gradient accumulation and
    /// `-zerograd` for gradients zeroed in place (so configs never share a name), with anything
    /// that is not safe in a file name replaced. A model named by its path goes by its file's
    /// name, or its folder's for a `config.json`: the plots land in a folder of their own.
    pub fn file_stem(&self) -> String {
        let mut parts = self.model.rsplit(['/', '\\']).filter(|p| !p.is_empty());
        let model = match parts.next() {
            Some("config.json") => parts.next().unwrap_or("config.json"),
            Some(last) => last,
            None => &self.model,
        };
        let mut s = format!("{model}-{}-{}-mb{}", self.precision, self.optimizer, self.micro_batch);
        if self.grad_accum != 1 {
            s.push_str(&format!("-ga{}", self.grad_accum));
        }
        if !self.set_to_none {
            s.push_str("-zerograd");
        }
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.+".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }

    pub(super) fn config_line(&self) -> String {
        let batch = if self.grad_accum == 1 {
            format!("batch {}", self.micro_batch)
        } else {
            format!("batch {} × {} accumulated", self.micro_batch, self.grad_accum)
        };
        let grads = if self.set_to_none {
            ""
        } else {
            " · grads zeroed in place"
        };
        format!(
            "{batch} · {} · {}{grads} · {}",
            self.precision, self.optimizer, self.device
        )
    }
}

/// A position in the trade-off plane, in percent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tradeoff {
    /// `100 × (1 − t_none / t_subset)`: the share of throughput lost to recomputation.
    pub throughput_lost_pct: f64,
    /// `100 × (1 − peak_subset / peak_none)`: the share of peak memory saved.
    pub memory_saved_pct: f64,
}

/// One checkpoint subset: measured (filled marker), predicted (hollow marker), or both.
#[derive(Debug, Clone, PartialEq)]
pub struct TradeoffPoint {
    /// Legend text, e.g. from [`subset_label`].
    pub label: String,
    /// Whether nothing is checkpointed: the reference point, drawn in black.
    pub baseline: bool,
    pub measured: Option<Tradeoff>,
    pub predicted: Option<Tradeoff>,
    /// Throughput lost by the fastest and the slowest timed step, drawn as a whisker through
    /// the measured marker: on a shared machine one slow step can move a median far.
    pub throughput_lost_range_pct: Option<(f64, f64)>,
    /// Throughput lost as predicted from the profile's fastest and slowest samples, drawn as a
    /// whisker through the predicted marker.
    pub predicted_range_pct: Option<(f64, f64)>,
}

/// What checkpointing one candidate block alone saves and costs.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateBar {
    pub block: String,
    pub saved_bytes: i64,
    /// `saved_bytes` as a percentage of the peak with nothing checkpointed.
    pub saved_pct: f64,
    /// Recompute time, and its percentage of the step time with nothing checkpointed.
    pub cost_seconds: f64,
    pub cost_pct: f64,
    /// `cost_pct` from the fastest and the slowest timed step, drawn as a whisker.
    pub cost_range_pct: Option<(f64, f64)>,
}

/// How a candidate's saving was obtained, which decides how the chart words it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CandidateBasis {
    /// From a sweep: peak and step time of the block checkpointed alone against nothing.
    Measured,
    /// From a profile: the activation bytes the block stops keeping (its peak effect can be
    /// smaller, because the peak may move to another moment) and its recompute time.
    Profiled,
    /// As `Profiled`, with the recompute time the cost model's estimate.
    Estimated,
}

/// A legend label for a set of module names: names that differ only after their last dot are
/// grouped, and numeric runs shortened (`encoder.layer.{0–3,7}`), so a 12-layer subset stays
/// one line. Nothing checkpointed reads as such.
pub fn subset_label(modules: &[String]) -> String {
    if modules.is_empty() {
        return "nothing checkpointed".into();
    }
    // Groups in first-seen order, so the label follows the chain.
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for m in modules {
        let (prefix, last) = match m.rsplit_once('.') {
            Some((p, l)) => (p.to_owned(), l.to_owned()),
            None => (String::new(), m.clone()),
        };
        match groups.iter_mut().find(|(p, _)| *p == prefix && !p.is_empty()) {
            Some((_, v)) => v.push(last),
            None => groups.push((prefix, vec![last])),
        }
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|(prefix, lasts)| {
            if prefix.is_empty() {
                lasts.join(" + ")
            } else if lasts.len() == 1 {
                format!("{prefix}.{}", lasts[0])
            } else {
                format!("{prefix}.{{{}}}", compress_runs(&lasts))
            }
        })
        .collect();
    parts.join(" + ")
}

/// `0,1,2,3,7` → `0–3,7`; non-numeric items are kept as they are.
fn compress_runs(items: &[String]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let mut j = i;
        if let Ok(start) = items[i].parse::<u64>() {
            while j + 1 < items.len() && items[j + 1].parse::<u64>().ok() == Some(start + (j + 1 - i) as u64) {
                j += 1;
            }
        }
        out.push(match j - i {
            0 => items[i].clone(),
            1 => format!("{},{}", items[i], items[j]),
            _ => format!("{}–{}", items[i], items[j]),
        });
        i = j + 1;
    }
    out.join(",")
}
