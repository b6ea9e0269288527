//! How fast the caching-allocator simulation replays a trace: a seeded, training-like trace of
//! about 10^6 events (per step a forward that keeps activations and frees temporaries, a
//! backward that frees them in reverse and makes gradients, an optimizer step, a mark per
//! phase) replayed under the default config and under expandable segments.
//!
//!     cargo run --release -p ckptune-solver --example bench_alloc_replay

use std::time::Instant;

use ckptune_solver::caching_allocator::{replay, AllocatorConfig, TraceEvent};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const EVENTS: usize = 1_000_000;
const LAYERS: usize = 48;

fn main() {
    let events = training_trace(EVENTS, 7);
    for conf in [
        "",
        "expandable_segments:True",
        "max_split_size_mb:128,roundup_power2_divisions:4",
    ] {
        let config = AllocatorConfig::parse(conf).expect("a valid config");
        let start = Instant::now();
        let r = replay(&events, config, None).expect("no capacity needed");
        let seconds = start.elapsed().as_secs_f64();
        let peak = r.spans.iter().map(|s| s.peak_reserved_bytes).max().unwrap_or(0);
        println!(
            "{:>50}: {} events in {:.3} s ({:.2} M events/s), {} spans, peak reserved {} MiB",
            format!("{conf:?}"),
            r.after_event.len(),
            seconds,
            r.after_event.len() as f64 / seconds / 1e6,
            r.spans.len(),
            peak >> 20
        );
    }
}

/// Steps of forward, backward and optimizer until `target` events.
fn training_trace(target: usize, seed: u64) -> Vec<TraceEvent> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = Trace::default();
    // Parameters and optimizer state live throughout.
    let params: Vec<u64> = (0..LAYERS).map(|_| t.alloc(rng.random_range(1..64) << 20, 0)).collect();
    let mut grads: Vec<u64> = Vec::new();
    while t.events.len() < target {
        t.events.push(TraceEvent::Mark("forward".into()));
        let mut saved = Vec::new();
        for _ in 0..LAYERS {
            for _ in 0..rng.random_range(2..6) {
                saved.push(t.alloc(activation(&mut rng), 0));
            }
            let temporary = t.alloc(activation(&mut rng), rng.random_range(0..2));
            t.free(temporary);
        }
        t.events.push(TraceEvent::Mark("backward".into()));
        for id in grads.drain(..) {
            t.free(id);
        }
        while let Some(id) = saved.pop() {
            let grad_input = t.alloc(activation(&mut rng), 0);
            t.free(id);
            t.free(grad_input);
        }
        grads.extend(params.iter().map(|_| t.alloc(rng.random_range(1..64) << 20, 0)));
        t.events.push(TraceEvent::Mark("optimizer".into()));
        for _ in 0..LAYERS {
            let state = t.alloc(rng.random_range(1..64) << 20, 0);
            t.free(state);
        }
    }
    t.events
}

/// Activation sizes from bias vectors to attention scores.
fn activation(rng: &mut StdRng) -> u64 {
    match rng.random_range(0..4) {
        0 => rng.random_range(1..4096),
        1 => rng.random_range(4096..1 << 20),
        2 => rng.random_range(1 << 20..16 << 20),
        _ => rng.random_range(16 << 20..256 << 20),
    }
}

#[derive(Default)]
struct Trace {
    events: Vec<TraceEvent>,
    next: u64,
}

impl Trace {
    fn alloc(&mut self, bytes: u64, stream: u32) -> u64 {
        self.next += 1;
        self.events.push(TraceEvent::Alloc {
            id: self.next,
            bytes,
            stream,
        });
        self.next
    }

    fn free(&mut self, id: u64) {
        self.events.push(TraceEvent::Free { id });
    }
}
