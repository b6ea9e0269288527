//! Table-driven tests of size parsing and printing: every accepted spelling, every
//! rejection with its message, and the round trip through `format_size`.

use ckptune_solver::budget::{format_size, parse_size};

#[test]
fn parses_accepted_forms() {
    let cases: &[(&str, u64)] = &[
        ("123456", 123_456),
        ("0", 0),
        ("  42  ", 42),
        ("42B", 42),
        ("42 b", 42),
        ("12GiB", 12 << 30),
        ("12G", 12 << 30),
        ("12g", 12 << 30),
        ("12 gib", 12 << 30),
        ("12GB", 12_000_000_000),
        ("12000MB", 12_000_000_000),
        ("12000mb", 12_000_000_000),
        ("1.5TiB", 3 << 39),
        ("1.5T", 3 << 39),
        ("2TB", 2_000_000_000_000),
        ("512KiB", 512 << 10),
        ("512K", 512 << 10),
        ("1KB", 1000),
        ("3M", 3 << 20),
        ("3MiB", 3 << 20),
        (".5KiB", 512),
        ("5.", 5),
        ("+7", 7),
        ("1.1KiB", 1126),  // 1126.4 bytes: the fraction of a byte is dropped
        ("0.0000001K", 0), // likewise
        ("2PiB", 2 << 50),
        ("2P", 2 << 50),
        ("2PB", 2_000_000_000_000_000),
        ("15EiB", 15 << 60),
        ("1e", 1 << 60),
        ("0.000000000000000001E", 1),
    ];
    for &(s, want) in cases {
        assert_eq!(parse_size(s), Ok(want), "{s:?}");
    }
    assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    assert_eq!(parse_size("16777215.99999999999999TiB"), Ok(u64::MAX));
}

#[test]
fn rejects_with_a_message_naming_the_input() {
    let cases: &[(&str, &str)] = &[
        ("", "it is empty"),
        ("   ", "it is empty"),
        ("-1G", "cannot be negative"),
        ("NaN", "does not start with a number"),
        ("inf", "does not start with a number"),
        ("GiB", "does not start with a number"),
        (".", "does not start with a number"),
        ("1.2.3G", "more than one decimal point"),
        ("12 GiBs", "unknown unit \"GiBs\""),
        ("12ZiB", "unknown unit \"ZiB\""),
        ("1.0000000000000000001G", "more than 18 decimal digits"),
        ("16EiB", "more than 2^64"),
        ("12 G B", "unknown unit \"G B\""),
        ("1e9", "unknown unit \"e9\""),
        ("18446744073709551616", "more than 2^64"),
        ("16777216TiB", "more than 2^64"),
        ("99999999999999999999999999999999999999999", "more than 2^64"),
    ];
    for &(s, want) in cases {
        let e = parse_size(s).unwrap_err().to_string();
        assert!(e.contains(want), "{s:?}: {e}");
        assert!(e.contains(&format!("{s:?}")), "{s:?}: {e}");
    }
    let e = parse_size("12 GiBs").unwrap_err().to_string();
    assert!(e.contains("K/M/G/T/P/E (1024-based)"), "{e}");
}

#[test]
fn formats_sizes() {
    let cases: &[(u64, &str)] = &[
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        ((1 << 20) - 1, "1.00 MiB"),
        (23 << 29, "11.50 GiB"),
        (3 << 39, "1.50 TiB"),
        (u64::MAX, "16.00 EiB"),
    ];
    for &(b, want) in cases {
        assert_eq!(format_size(b), want, "{b}");
    }
}

#[test]
fn format_round_trips_within_half_a_percent() {
    let mut b: u64 = 1;
    while b < 1 << 62 {
        for v in [b, b + b / 3, b * 7 / 5] {
            let back = parse_size(&format_size(v)).unwrap();
            let err = (back as f64 - v as f64).abs() / v as f64;
            assert!(err <= 0.005, "{v} → {} → {back}", format_size(v));
        }
        b = b * 3 + 1;
    }
}

#[test]
fn budgets_are_sizes_or_shares_of_what_checkpointing_saves() {
    use ckptune_solver::budget::{parse_budget, Budget};
    assert_eq!(parse_budget("12GiB"), Ok(Budget::Bytes(12 << 30)));
    assert_eq!(parse_budget("80%"), Ok(Budget::Percent(80.0)));
    assert_eq!(parse_budget(" 62.5 % "), Ok(Budget::Percent(62.5)));
    assert_eq!(parse_budget("0%"), Ok(Budget::Percent(0.0)));
    assert_eq!(parse_budget("100%"), Ok(Budget::Percent(100.0)));
    // From the smallest peak (0%) to the unconstrained one (100%), rounding down: the resolved
    // budget never exceeds the share asked for.
    assert_eq!(Budget::Percent(80.0).resolve(1000, 2001), 1800);
    assert_eq!(Budget::Percent(0.0).resolve(1000, 2001), 1000);
    assert_eq!(Budget::Percent(100.0).resolve(1000, 2001), 2001);
    // Nothing to save: every share is the one peak there is.
    assert_eq!(Budget::Percent(50.0).resolve(1000, 1000), 1000);
    assert_eq!(Budget::Bytes(5).resolve(1000, 2001), 5);
    for input in ["-5%", "150%", "NaN%", "inf%"] {
        let e = parse_budget(input).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{input:?}")) && e.contains("outside 0% to 100%"),
            "{input}: {e}"
        );
    }
    for input in ["%", "eighty%"] {
        let e = parse_budget(input).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{input:?}")) && e.contains("not a number"),
            "{input}: {e}"
        );
    }
    // Anything else is a size, with the size's error.
    assert!(parse_budget("12 apples")
        .unwrap_err()
        .to_string()
        .contains("unknown unit"));
}
