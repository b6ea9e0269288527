//! Standard output for every command. A closed stdout (`ckptune models | head -1`) is not an
//! error of the command: printing stops quietly and the command finishes its work (outputs
//! to files are still written), as ripgrep treats a broken pipe. Any other write error is
//! remembered and reported once the command is done.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use ckptune_solver::formats::{self, Document};

static CLOSED: AtomicBool = AtomicBool::new(false);
static FAILED: Mutex<Option<String>> = Mutex::new(None);

/// Writes one line to stdout; see the module docs for what happens when stdout is gone.
pub fn write_line(args: std::fmt::Arguments<'_>) {
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    let result = out.write_fmt(args).and_then(|()| out.write_all(b"\n"));
    if let Err(e) = result {
        CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            if let Ok(mut f) = FAILED.lock() {
                f.get_or_insert_with(|| format!("writing to standard output: {e}"));
            }
        }
    }
}

/// A write error on stdout other than a closed pipe, if one happened.
pub fn write_failure() -> Option<String> {
    std::io::stdout().flush().ok();
    FAILED.lock().ok().and_then(|f| f.clone())
}

/// `println!` for commands: never panics on a closed stdout.
macro_rules! outln {
    () => {
        $crate::cli::output::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::cli::output::write_line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

/// A document as pretty JSON on stdout (`--json`).
pub fn print_json<T: Document>(value: &T) -> anyhow::Result<()> {
    write_line(format_args!("{}", formats::to_pretty(value)?));
    Ok(())
}

/// `1234567` → `1,234,567`.
pub fn group_digits(n: i64) -> String {
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}
