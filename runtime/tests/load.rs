//! The contention detector against real load: a busy process elsewhere is contention, this
//! process's own threads are not (docs/timing.md). No assertion is on a duration: the busy
//! process takes a whole core whatever the machine's speed, and the own-threads check compares
//! windows measured back to back on the same machine.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckptune_runtime::load::{CpuCounters, Load};

/// The two tests measure the whole machine: one at a time.
static MACHINE: Mutex<()> = Mutex::new(());

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The load over `window` while `work` runs, for a step with one thread per CPU.
fn measure(window: Duration, work: impl FnOnce(Duration)) -> Load {
    let a = CpuCounters::read().expect("/proc/stat and /proc/self/stat are readable on Linux");
    work(window);
    let b = CpuCounters::read().expect("counters");
    a.until(&b, cpus())
}

/// A child process spinning on one core until killed (also on a failed assertion).
struct Busy(Child);

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_busy_process_elsewhere_is_contention() {
    let _machine = MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let _busy = Busy(
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("spawning sh"),
    );
    // Let it start spinning, then measure a second while this process sleeps.
    std::thread::sleep(Duration::from_millis(200));
    let load = measure(Duration::from_secs(1), std::thread::sleep);
    assert!(
        load.contended(),
        "a process spinning on one core during the window was not seen: {load:?} (other {:.2} cores)",
        load.other_cores()
    );
    assert!(load.other_cores() > 0.5, "{load:?}");
}

#[test]
fn this_process_own_threads_are_not_contention() {
    let _machine = MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let spin = |window: Duration| {
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..cpus())
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                    }
                })
            })
            .collect();
        let t0 = Instant::now();
        std::thread::sleep(window.saturating_sub(t0.elapsed()));
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().expect("spinning thread");
        }
    };
    // Windows back to back: quiet, own threads spinning on every CPU, quiet. Spinning must
    // show as own time, and must not raise the other load above what the quiet windows on
    // either side saw (a burst elsewhere can coincide with one window, so a few tries).
    let mut tries = Vec::new();
    for _ in 0..4 {
        let before = measure(Duration::from_millis(600), std::thread::sleep);
        let during = measure(Duration::from_millis(600), spin);
        let after = measure(Duration::from_millis(600), std::thread::sleep);
        let others = before.other_cores().max(after.other_cores());
        if during.own_cpu_seconds > 0.25 * during.wall_seconds && during.other_cores() <= others + 0.5 {
            return;
        }
        tries.push((
            before.other_cores(),
            during.other_cores(),
            during.own_cores(),
            after.other_cores(),
        ));
    }
    panic!(
        "own spinning threads counted as other load, or not as own: (other before, other during, \
         own during, other after) in cores per try: {tries:?}"
    );
}
