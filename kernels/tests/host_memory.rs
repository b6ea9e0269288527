//! `HostMemoryHold` against the kernel's own count of page faults, with tensors allocated as the
//! runtime's are (by the meter): without a hold glibc maps a large tensor afresh every time (each
//! of its pages faulted in again); with one, a round reuses the pages of the round before; when
//! the last hold ends, what is free goes back.
//!
//! Run on the main thread, without libtest (`harness = false` in Cargo.toml): glibc serves the
//! step's thread from its main heap only there (another thread's heaps cannot hold a block this
//! large and map it regardless), and nothing else in the process allocates while it counts. It
//! reports in libtest's words, which scripts/test tallies.

use ckptune_kernels::host_memory::HostMemoryHold;
use ckptune_kernels::meter;
use tch::{Kind, Tensor};

const PAGE: i64 = 4096;
/// Above glibc's largest mmap threshold (32 MiB), so that without a hold it is always mapped.
const BYTES: i64 = 64 << 20;

/// This process's minor page faults so far (`/proc/self/stat`'s minflt, field 10, counted from
/// after the command's closing parenthesis, as the command may hold spaces). The runtime's
/// `load::OwnStat` reads the same, but this crate comes before the runtime.
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(7)?.parse().ok()
}

/// Faults taken by allocating a tensor of `BYTES`, writing every page and freeing it.
fn faults_of_a_round() -> u64 {
    let before = minor_faults().expect("/proc/self/stat");
    let t = Tensor::ones([BYTES / 4], (Kind::Float, tch::Device::Cpu));
    assert_eq!(t.sum(Kind::Float).double_value(&[]), (BYTES / 4) as f64);
    drop(t);
    minor_faults().expect("/proc/self/stat") - before
}

/// Whether the kernel backs every mapping with huge pages where it can, so that a fresh mapping
/// takes one fault per 2 MiB rather than per page.
fn huge_pages_always() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|s| s.contains("[always]"))
}

fn resident_bytes() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    statm.split_whitespace().nth(1).unwrap().parse::<i64>().unwrap() * PAGE
}

fn main() {
    if HostMemoryHold::supported() {
        a_hold_keeps_freed_pages_until_the_last_hold_ends();
        println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
    } else {
        // Not glibc: a hold does nothing, and nothing here would hold.
        println!("test result: ok. 0 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out");
    }
}

fn a_hold_keeps_freed_pages_until_the_last_hold_ends() {
    meter::install().unwrap();
    tch::set_num_threads(1); // every page written by this thread, in this count
    let pages = (BYTES / PAGE) as u64;
    faults_of_a_round();
    let unheld = faults_of_a_round();
    if !huge_pages_always() {
        assert!(
            unheld >= pages * 9 / 10,
            "without a hold the tensor is mapped afresh: {unheld} faults for {pages} pages"
        );
    }

    let outer = HostMemoryHold::new();
    faults_of_a_round(); // grows the heap once
    for round in 0..3 {
        let held = faults_of_a_round();
        assert!(
            held < pages / 20,
            "round {round} under a hold faulted {held} of {pages} pages"
        );
    }
    let inner = HostMemoryHold::new();
    let held_rss = resident_bytes();
    drop(inner); // not the last: the freed tensor's pages stay
    assert!(
        resident_bytes() >= held_rss - BYTES / 8,
        "an inner hold's end returned the outer's pages"
    );
    assert!(faults_of_a_round() < pages / 20);
    drop(outer);
    let returned = held_rss - resident_bytes();
    assert!(
        returned >= BYTES * 3 / 4,
        "the last hold's end returned {returned} B of the {BYTES} B freed"
    );
}
