//! How much CPU the rest of the machine took while this process timed a step: the basis of
//! contention detection (docs/timing.md).
//!
//! Two counters are read before and after the step: the busy time of the CPUs this process
//! may run on (`/proc/stat`, every CPU of `Cpus_allowed_list`; user, nice, system, irq,
//! softirq and steal — steal is a hypervisor giving the CPU to another machine), and this
//! process's own CPU time, all threads together (`/proc/self/stat`, utime + stime). Busy
//! minus own is what everything else used. Both are in clock ticks (`USER_HZ`, 100 per second
//! on every Linux architecture ckptune builds for), so a reading is exact to about one tick
//! per CPU plus one for the process: [`Load::resolution_cores`], which the contention rule
//! subtracts before comparing, so a step too short to tell is never called contended.
//!
//! Where `/proc` cannot be read (not Linux) nothing is measured and samples are unchecked.

use std::sync::OnceLock;
use std::time::Instant;

/// Clock ticks per second of `/proc/stat` and `/proc/<pid>/stat` (Linux's `USER_HZ`).
const USER_HZ: f64 = 100.0;

/// Other load tolerated beyond the CPUs this process leaves free, in cores: a quarter of a
/// core, well above what background daemons use and well below one busy process on a CPU a
/// thread of the step wants (which takes half a core or more from a 2-thread step on 2 CPUs).
pub const QUIET_CORES: f64 = 0.25;

/// Counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuCounters {
    at: Instant,
    /// Busy ticks of the allowed CPUs, summed.
    busy_ticks: u64,
    /// This process's user + system ticks, every thread included.
    own_ticks: u64,
    /// Of those, system ticks: the kernel's work for the process, mostly page faults.
    own_system_ticks: u64,
}

/// The CPU use around one timed interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    pub wall_seconds: f64,
    /// CPU seconds the rest of the machine used on the CPUs this process may run on (never
    /// negative: tick rounding can make busy − own dip below zero).
    pub other_cpu_seconds: f64,
    /// CPU seconds of this process, all its threads.
    pub own_cpu_seconds: f64,
    /// Of those, the kernel's (system time): mostly the page faults of memory touched fresh.
    pub own_system_seconds: f64,
    /// CPUs this process may run on, and the intra-op threads it ran with.
    pub cpus: usize,
    pub threads: usize,
}

/// CPUs the process may run on, from `Cpus_allowed_list` (`0-3,8,10-11`); `None` when it
/// cannot be read.
fn allowed_cpus() -> Option<&'static [usize]> {
    static CPUS: OnceLock<Option<Vec<usize>>> = OnceLock::new();
    CPUS.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
            .trim()
            .to_owned();
        parse_cpu_list(&list)
    })
    .as_deref()
}

/// `0-3,8` → `[0, 1, 2, 3, 8]`.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.trim().parse::<usize>().ok()?..=b.trim().parse::<usize>().ok()?),
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// Busy ticks of `cpus` from `/proc/stat`'s `cpuN` lines.
fn busy_ticks(stat: &str, cpus: &[usize]) -> Option<u64> {
    let mut total = 0u64;
    let mut found = 0;
    for line in stat.lines() {
        let Some(rest) = line.strip_prefix("cpu") else {
            // The cpu lines come first.
            break;
        };
        let mut fields = rest.split_whitespace();
        let Some(Ok(n)) = fields.next().map(str::parse::<usize>) else {
            continue; // the aggregate `cpu` line
        };
        if !cpus.contains(&n) {
            continue;
        }
        let v: Vec<u64> = fields.map(|f| f.parse().unwrap_or(0)).collect();
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        total += at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
        found += 1;
    }
    (found > 0).then_some(total)
}

/// This process's counters in `/proc/self/stat`, so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OwnStat {
    /// Pages the kernel mapped in for the process without reading a disk (minflt).
    pub minor_faults: u64,
    /// CPU time in user and in kernel mode, every thread, in ticks of `USER_HZ`.
    pub user_ticks: u64,
    pub system_ticks: u64,
}

impl OwnStat {
    /// The counters now; `None` where `/proc` cannot be read.
    pub fn read() -> Option<OwnStat> {
        OwnStat::parse(&std::fs::read_to_string("/proc/self/stat").ok()?)
    }

    /// minflt, utime and stime (fields 10, 14 and 15; the command name in field 2 may hold
    /// spaces and parentheses, so fields are counted from the last `)`).
    fn parse(stat: &str) -> Option<OwnStat> {
        let after = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        Some(OwnStat {
            minor_faults: fields.get(7)?.parse().ok()?,
            user_ticks: fields.get(11)?.parse().ok()?,
            system_ticks: fields.get(12)?.parse().ok()?,
        })
    }

    /// The kernel-mode CPU time in seconds.
    pub fn system_seconds(&self) -> f64 {
        self.system_ticks as f64 / USER_HZ
    }
}

impl CpuCounters {
    /// The counters now; `None` where `/proc` cannot be read.
    pub fn read() -> Option<CpuCounters> {
        let cpus = allowed_cpus()?;
        let own = OwnStat::read()?;
        let busy = busy_ticks(&std::fs::read_to_string("/proc/stat").ok()?, cpus)?;
        Some(CpuCounters {
            at: Instant::now(),
            busy_ticks: busy,
            own_ticks: own.user_ticks + own.system_ticks,
            own_system_ticks: own.system_ticks,
        })
    }

    /// The load from `self` to `later`, for a process running `threads` intra-op threads.
    pub fn until(&self, later: &CpuCounters, threads: usize) -> Load {
        let busy = later.busy_ticks.saturating_sub(self.busy_ticks) as f64 / USER_HZ;
        let own = later.own_ticks.saturating_sub(self.own_ticks) as f64 / USER_HZ;
        let system = later.own_system_ticks.saturating_sub(self.own_system_ticks) as f64 / USER_HZ;
        Load {
            wall_seconds: later.at.duration_since(self.at).as_secs_f64(),
            other_cpu_seconds: (busy - own).max(0.0),
            own_cpu_seconds: own,
            own_system_seconds: system,
            cpus: allowed_cpus().map_or(1, <[usize]>::len),
            threads,
        }
    }
}

impl Load {
    /// What the rest of the machine used, in cores (CPU seconds per second).
    pub fn other_cores(&self) -> f64 {
        self.other_cpu_seconds / self.wall_seconds.max(f64::MIN_POSITIVE)
    }

    /// What this process used, in cores.
    pub fn own_cores(&self) -> f64 {
        self.own_cpu_seconds / self.wall_seconds.max(f64::MIN_POSITIVE)
    }

    /// The counters' rounding over this interval, in cores: one tick per CPU and one for the
    /// process.
    pub fn resolution_cores(&self) -> f64 {
        (self.cpus + 1) as f64 / USER_HZ / self.wall_seconds.max(f64::MIN_POSITIVE)
    }

    /// Whether the interval was long enough to judge: one busy core beyond the free ones would
    /// be called contended through the counters' rounding.
    pub fn judged(&self) -> bool {
        self.resolution_cores() + QUIET_CORES < 1.0
    }

    /// CPUs the step's threads leave to others.
    pub fn free_cores(&self) -> f64 {
        self.cpus.saturating_sub(self.threads) as f64
    }

    /// Contended: even after the counters' rounding, the rest of the machine used more than
    /// the CPUs this process leaves free plus [`QUIET_CORES`], so some of the step's threads
    /// had to share a CPU.
    pub fn contended(&self) -> bool {
        self.other_cores() - self.resolution_cores() > self.free_cores() + QUIET_CORES
    }
}

/// What the rest of the machine leaves this process, measured over `window` before any work:
/// the CPUs it may run on, less every core the others kept busy beyond the tolerated
/// [`QUIET_CORES`] and the counters' rounding (a core half taken counts as taken: a thread
/// sharing a core stalls the others at every barrier). At least one; `None` where `/proc`
/// cannot be read. Returns the free CPUs and the other load in cores.
pub fn free_cpus(window: std::time::Duration) -> Option<(usize, f64)> {
    let before = CpuCounters::read()?;
    std::thread::sleep(window);
    let load = before.until(&CpuCounters::read()?, 0);
    Some((free_of(&load), load.other_cores()))
}

fn free_of(load: &Load) -> usize {
    let taken = (load.other_cores() - load.resolution_cores() - QUIET_CORES)
        .max(0.0)
        .ceil() as usize;
    load.cpus.saturating_sub(taken).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_core_is_taken_and_daemons_are_not() {
        let load = |other: f64, wall: f64| Load {
            wall_seconds: wall,
            other_cpu_seconds: other * wall,
            own_cpu_seconds: 0.0,
            own_system_seconds: 0.0,
            cpus: 2,
            threads: 0,
        };
        // Over 0.4 s on 2 CPUs the counters round by 0.075 cores.
        assert_eq!(free_of(&load(0.0, 0.4)), 2);
        assert_eq!(free_of(&load(0.3, 0.4)), 2, "background daemons");
        assert_eq!(free_of(&load(0.6, 0.4)), 1, "half a core taken");
        assert_eq!(free_of(&load(1.0, 0.4)), 1, "one busy process");
        assert_eq!(free_of(&load(2.0, 0.4)), 1, "never none");
    }

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn busy_ticks_sum_the_allowed_cpus_without_idle_and_iowait() {
        let stat = "cpu  30 0 6 100 4 0 0 0 0 0\n\
                    cpu0 10 1 2 50 3 1 1 2 0 0\n\
                    cpu1 20 0 4 50 1 0 0 0 0 0\n\
                    intr 1 2 3\n";
        assert_eq!(busy_ticks(stat, &[0]), Some(10 + 1 + 2 + 1 + 1 + 2));
        assert_eq!(busy_ticks(stat, &[0, 1]), Some(17 + 24));
        assert_eq!(busy_ticks(stat, &[7]), None);
    }

    #[test]
    fn own_stat_reads_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 731 29 0 0 20 0 3 0 5 0 0";
        let own = OwnStat::parse(stat).unwrap();
        assert_eq!((own.minor_faults, own.user_ticks, own.system_ticks), (100, 731, 29));
    }

    fn load(wall: f64, other: f64, cpus: usize, threads: usize) -> Load {
        Load {
            wall_seconds: wall,
            other_cpu_seconds: other,
            own_cpu_seconds: 0.0,
            own_system_seconds: 0.0,
            cpus,
            threads,
        }
    }

    #[test]
    fn the_rule_allows_free_cpus_and_the_counters_rounding() {
        // Two CPUs, two threads: one busy core elsewhere over a second is contention.
        assert!(load(1.0, 1.0, 2, 2).contended());
        // A tenth of a core is not.
        assert!(!load(1.0, 0.1, 2, 2).contended());
        // One thread on two CPUs leaves one free: a busy core fits there.
        assert!(!load(1.0, 1.0, 2, 1).contended());
        assert!(load(1.0, 1.9, 2, 1).contended());
        // A 20 ms step cannot resolve one core of other load (3 ticks of rounding = 1.5 cores).
        assert!(!load(0.02, 0.02, 2, 2).contended());
        assert!(!load(0.02, 0.0, 2, 2).judged());
        assert!(load(0.1, 0.0, 2, 2).judged());
    }
}
