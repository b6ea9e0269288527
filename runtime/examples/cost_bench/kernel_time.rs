//! What the kernel did for this process: its minor page faults and the system CPU seconds they
//! and every other system call took, from `/proc/self/stat`. No estimate holds this time (a
//! fault's price is the host's), so the benchmark reports it beside each measured step.

use std::ops::Sub;

use ckptune_runtime::load::OwnStat;

/// This process's minor page faults and system CPU seconds, so far or over a span.
#[derive(Debug, Clone, Copy)]
pub struct KernelTime {
    pub minor_faults: u64,
    pub system_seconds: f64,
}

impl KernelTime {
    /// So far in this process, where `/proc` can say.
    pub fn now() -> Option<KernelTime> {
        let own = OwnStat::read()?;
        Some(KernelTime {
            minor_faults: own.minor_faults,
            system_seconds: own.system_seconds(),
        })
    }

    /// What `f` returned and what it cost the kernel, where `/proc` can say.
    pub fn of<T>(f: impl FnOnce() -> T) -> (T, Option<KernelTime>) {
        let before = KernelTime::now();
        let out = f();
        (out, before.zip(KernelTime::now()).map(|(b, a)| a - b))
    }
}

impl Sub for KernelTime {
    type Output = KernelTime;

    fn sub(self, earlier: KernelTime) -> KernelTime {
        KernelTime {
            minor_faults: self.minor_faults - earlier.minor_faults,
            system_seconds: self.system_seconds - earlier.system_seconds,
        }
    }
}
