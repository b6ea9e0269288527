//! Every subcommand gives the same exit code for the same bad input (2, decided by the
//! error's type in one place), and none panics when its standard output is already closed
//! (`ckptune models | head -1`): printing stops quietly and the work finishes.

mod common;

use std::process::{Command, Stdio};

use common::{ok, refused, COMMON};

const TINY_BERT: [&str; 7] = ["tiny-bert", "--batch", "2", "--seq", "8", "--precision", "fp32"];

#[test]
fn the_same_bad_input_exits_2_in_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let corrupt = dir.path().join("corrupt.json");
    std::fs::write(&corrupt, "{ not json").unwrap();
    let corrupt = corrupt.to_str().unwrap();
    // A document that cannot be read, wherever a command reads one.
    for args in [
        vec!["plan", "--budget", "1GiB", "tiny-bert", "--profile", corrupt],
        vec!["sweep", "tiny-bert", "--checkpoint", "x", "--profile", corrupt],
        vec!["verify", corrupt],
        vec!["verify", corrupt, "--pytorch"],
        vec!["emit", "python", corrupt],
        vec!["train", "tiny-bert", "--plan", corrupt],
        vec!["plot", corrupt],
    ] {
        refused(&args, &["corrupt.json"]);
    }
    // A model file that does not exist, wherever a command takes a model.
    let missing = "/nonexistent/model.safetensors";
    for args in [
        vec!["profile", missing],
        vec!["sweep", missing, "--checkpoint", "x"],
        vec!["plan", "--budget", "1GiB", missing],
        vec!["train", missing],
    ] {
        refused(&args, &[missing]);
    }
    // A flag value out of range, wherever the flag exists.
    for cmd in [
        vec!["profile"],
        vec!["sweep", "--all-subsets"],
        vec!["plan", "--budget", "1GiB"],
        vec!["train"],
    ] {
        let mut args = cmd.clone();
        args.extend(["tiny-bert", "--batch", "0"]);
        refused(&args, &["--batch 0"]);
    }
}

/// Runs `args` with stdout a pipe whose reading end is closed before the command starts.
fn run_with_closed_stdout(args: &[&str]) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_ckptune"))
        .args(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "ckptune {args:?} panicked: {stderr}");
    assert_eq!(out.status.code(), Some(0), "ckptune {args:?}: {stderr}");
}

#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let plan = dir.path().join("plan.json");
    let with = |base: &[&str], extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).chain(&COMMON).map(|s| s.to_string()).collect()
    };
    let profile_s = profile.to_str().unwrap();
    let plan_s = plan.to_str().unwrap();
    // The files the later commands read, made with stdout intact.
    let mut args = with(&["profile"], &TINY_BERT);
    args.extend(["--repeats", "1", "-o", profile_s].map(String::from));
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut args = with(&["plan", "--budget", "1GiB"], &TINY_BERT);
    args.extend(["--profile", profile_s, "-o", plan_s].map(String::from));
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());

    let plots = dir.path().join("plots");
    let commands: Vec<Vec<String>> = vec![
        vec!["models".into()],
        vec!["models".into(), "--json".into()],
        {
            let mut a = with(&["profile"], &TINY_BERT);
            a.extend(["--repeats", "1"].map(String::from));
            a
        },
        {
            let mut a = with(&["sweep"], &TINY_BERT);
            a.extend(["--checkpoint", r"encoder\.layer\.0", "--repeats", "1"].map(String::from));
            a
        },
        {
            let mut a = with(&["plan", "--budget", "1GiB"], &TINY_BERT);
            a.extend(["--profile", profile_s, "--json"].map(String::from));
            a
        },
        vec![
            "verify".into(),
            plan_s.into(),
            "--steps".into(),
            "1".into(),
            "--quiet".into(),
        ],
        vec!["emit".into(), "python".into(), plan_s.into()],
        {
            let mut a = with(&["train"], &TINY_BERT);
            a.extend(["--steps", "2"].map(String::from));
            a
        },
        vec![
            "plot".into(),
            profile_s.into(),
            "-o".into(),
            plots.to_str().unwrap().into(),
        ],
    ];
    for args in &commands {
        run_with_closed_stdout(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }
    // The work still finished: plot wrote its files although it could not say so.
    assert!(std::fs::read_dir(&plots).unwrap().count() > 0, "plot wrote nothing");
}

/// `stderr` says `what` exactly once: one message, not a message and its cause repeating it.
fn says_once(args: &[&str], what: &str) {
    let stderr = refused(args, &[what]);
    assert_eq!(
        stderr.matches(what).count(),
        1,
        "ckptune {args:?} should say {what:?} once: {stderr}"
    );
}

#[test]
fn common_mistakes_name_the_real_problem_once() {
    let dir = tempfile::tempdir().unwrap();
    // A program cut short in transfer, and a file that only bears the extension.
    let whole = std::fs::read(common::fixture("tiny_resnet.pt2")).unwrap();
    let cut = dir.path().join("cut.pt2");
    std::fs::write(&cut, &whole[..whole.len() / 3]).unwrap();
    let text = dir.path().join("notes.pt2");
    std::fs::write(&text, "not a program").unwrap();
    for file in [&cut, &text] {
        let file = file.to_str().unwrap();
        says_once(&["profile", file], "not a readable zip archive");
        says_once(&["profile", file], file);
    }
    // A folder that is not a Hugging Face model folder.
    let folder = dir.path().join("weights");
    std::fs::create_dir(&folder).unwrap();
    let folder = folder.to_str().unwrap();
    says_once(&["profile", folder], "is a folder without config.json");
    says_once(&["profile", folder], folder);
    // A checkpoint regex that matches no module would train with nothing checkpointed.
    let train = |regex: &str| -> Vec<String> {
        ["train", "tiny-resnet", "--steps", "1", "--checkpoint", regex]
            .into_iter()
            .chain(COMMON)
            .map(String::from)
            .collect()
    };
    let args = train("^nomatch$");
    says_once(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "matches no module of tiny-resnet",
    );
    let args = train("layer5");
    says_once(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "closest module names: layer1, layer2, layer3",
    );
    // Nothing checkpointed on purpose is still possible, with the empty regex.
    let args = train("");
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // A share outside 0..=100%.
    says_once(&["plan", "--budget", "150%", "tiny-resnet"], "outside 0% to 100%");
    // The chunked loss needs a language model's head, and at least one chunk.
    says_once(
        &[
            "profile",
            "tiny-bert",
            "--seq",
            "8",
            "--batch",
            "2",
            "--loss-chunks",
            "4",
        ],
        "tiny-bert's loss head is not a language model's",
    );
    says_once(&["profile", "tiny-gpt2", "--loss-chunks", "0"], "--loss-chunks 0");
}
