//! The progress bar of runs that take many steps (profiling, verifying, sweeping): on stderr,
//! hidden with `quiet`.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub fn progress_bar(len: u64, msg: &str, quiet: bool) -> ProgressBar {
    let target = if quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    let pb = ProgressBar::with_draw_target(Some(len), target);
    if let Ok(style) = ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} steps ({elapsed})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg.to_owned());
    pb
}
