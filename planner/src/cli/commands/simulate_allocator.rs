//! `ckptune simulate-allocator TRACE.json`: replays an allocation trace through the simulation
//! of PyTorch's CUDA caching allocator (`ckptune_solver::caching_allocator`) and prints, per
//! span between the trace's marks, the allocated and reserved peaks and the largest cached
//! free block; with `--every-event`, the state after each event (what `scripts/gpu_check`
//! compares with a GPU). Exit 1 when the trace runs out of memory (the step would crash there);
//! 2 for a trace, config or capacity that cannot be read, or a trace that frees what it never
//! allocated.

use std::process::ExitCode;

use anyhow::{Context, Result};
use ckptune_solver::budget::{format_size, parse_size};
use ckptune_solver::caching_allocator::{replay, AllocatorConfig, SimError};
use ckptune_solver::formats::{self, AllocReplayJson, AllocTraceJson, EVERY_EVENT_COLUMNS};

use crate::cli::args::SimulateAllocatorArgs;
use crate::cli::error::UsageError;
use crate::cli::output::{group_digits, outln};

pub fn simulate_allocator_cmd(a: SimulateAllocatorArgs) -> Result<ExitCode> {
    let shown = a.trace.display().to_string();
    let trace: AllocTraceJson = formats::read_tagged(&a.trace, formats::ALLOC_TRACE_FORMAT)?;
    let conf = a.alloc_conf.clone().unwrap_or_else(|| trace.alloc_conf.clone());
    let config = AllocatorConfig::parse(&conf).map_err(|e| UsageError(format!("simulating {shown}: {e}")))?;
    let capacity = match &a.capacity {
        Some(s) => Some(parse_size(s).context("--capacity")?),
        None => trace.capacity_bytes,
    };
    let r = replay(&trace.events, config, capacity).map_err(|e| UsageError(format!("simulating {shown}: {e}")))?;
    if let Some(stop) = r
        .stopped
        .as_ref()
        .filter(|s| !matches!(s.error, SimError::OutOfMemory(_)))
    {
        return Err(UsageError(format!("{shown}: event {}: {}", stop.event, stop.error)).into());
    }
    let doc = AllocReplayJson::new(&shown, &conf, capacity, trace.events.len(), &r, a.every_event);
    if let Some(out) = &a.output {
        formats::write_replay(out, &doc)?;
    }
    if a.json {
        outln!("{}", formats::replay_text(&doc)?);
    } else {
        print_replay(&doc);
    }
    match &doc.stopped {
        Some(stop) => {
            eprintln!(
                "error: {shown} runs out of memory at event {}: {}",
                stop.event, stop.error
            );
            Ok(ExitCode::from(1))
        }
        None => Ok(ExitCode::SUCCESS),
    }
}

fn print_replay(doc: &AllocReplayJson) {
    let capacity = doc.capacity_bytes.map_or("unlimited".to_string(), format_size);
    outln!(
        "{}: {} events, PYTORCH_CUDA_ALLOC_CONF {:?}, capacity {capacity}",
        doc.trace,
        group_digits(doc.events as i64),
        doc.alloc_conf
    );
    if let Some(every) = &doc.every_event {
        outln!(
            "{:>9}  {}",
            "event",
            EVERY_EVENT_COLUMNS.map(|c| format!("{c:>18}")).join(" ")
        );
        for (i, row) in every.rows.iter().enumerate() {
            outln!(
                "{i:>9}  {}",
                row.map(|v| format!("{:>18}", group_digits(v as i64))).join(" ")
            );
        }
    }
    outln!(
        "{:<28} {:>17} {:>15} {:>15} {:>22}",
        "span",
        "events",
        "peak allocated",
        "peak reserved",
        "largest free at end"
    );
    for s in &doc.spans {
        outln!(
            "{:<28} {:>17} {:>15} {:>15} {:>22}",
            s.name,
            format!("{}..{}", s.first_event, s.end_event),
            format_size(s.peak_allocated_bytes),
            format_size(s.peak_reserved_bytes),
            format_size(s.end.largest_free_block)
        );
    }
    let st = &doc.stats;
    outln!(
        "end: allocated {}, reserved {} ({} cudaMalloc segments), largest free block {}; {} retries, {} out-of-memory \
         errors",
        format_size(st.allocated_bytes.current),
        format_size(st.reserved_bytes.current),
        st.segment.current,
        format_size(st.largest_free_block),
        st.num_alloc_retries,
        st.num_ooms + st.num_oom_rejections
    );
}
