//! `PYTORCH_CUDA_ALLOC_CONF` as PyTorch parses it: defaults, forms and errors.

use super::*;

#[test]
fn config_defaults_and_forms() {
    assert_eq!(AllocatorConfig::parse("").unwrap(), AllocatorConfig::default());
    let c = AllocatorConfig::parse(" expandable_segments : True ,max_split_size_mb:128,").unwrap();
    assert!(c.expandable_segments);
    assert_eq!(c.max_split_size, 128 * MIB);
    // Keys that change no device accounting are accepted (and checked).
    let c = AllocatorConfig::parse(
        "backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,\
         pinned_num_register_threads:8,garbage_collection_threshold:0.6",
    )
    .unwrap();
    assert_eq!(c.garbage_collection_threshold, 0.6);
}

#[test]
fn config_errors_name_the_key_and_value() {
    let cases: &[(&str, &str)] = &[
        ("foo:1", "unrecognized key \"foo\""),
        (
            "expandable_segments:true",
            "expandable_segments:true: expected True or False",
        ),
        ("max_split_size_mb:10", "max_split_size_mb:10: too small, must be >= 20"),
        // large_segment_size_mb is read first, wherever it stands.
        (
            "max_split_size_mb:20,large_segment_size_mb:32",
            "max_split_size_mb:20: too small, must be >= 32",
        ),
        (
            "large_segment_size_mb:10",
            "large_segment_size_mb:10: too small, must be >= 11",
        ),
        (
            "garbage_collection_threshold:1.0",
            "garbage_collection_threshold:1.0: must be in (0.0, 1.0)",
        ),
        (
            "per_process_memory_fraction:1.5",
            "per_process_memory_fraction:1.5: must be in [0.0, 1.0]",
        ),
        (
            "roundup_power2_divisions:3",
            "roundup_power2_divisions:3: the divisions have to be a power of 2",
        ),
        (
            "roundup_power2_divisions:[256:3]",
            "divisions \"3\" are not a power of 2 or 0",
        ),
        (
            "roundup_power2_divisions:[300:2]",
            "interval \"300\" is not a power of 2",
        ),
        ("max_split_size_mb:12abc", "max_split_size_mb:12abc: not a whole number"),
        ("max_split_size_mb:[1:2]", "expected a single value, not a list"),
        ("pinned_num_register_threads:3", "power of 2, at most 128"),
        ("backend:cudaMallocAsync", "backend:cudaMallocAsync is not simulated"),
        (
            "max_split_size_mb",
            "expected \":\" after max_split_size_mb, found the end",
        ),
        (
            "max_split_size_mb:",
            "expected a value for max_split_size_mb, found the end",
        ),
        (
            "roundup_power2_divisions:[256,2]",
            "expected \":\" after 256, found \",\"",
        ),
        (
            "expandable_segments:True max_split_size_mb:40",
            "expected \",\" after a value, found \":\"",
        ),
    ];
    for (conf, expected) in cases {
        let e = AllocatorConfig::parse(conf).expect_err(conf);
        assert!(e.to_string().contains(expected), "{conf:?}: {e}");
    }
    assert!(matches!(
        AllocatorConfig::parse("foo:1"),
        Err(ConfigError::UnknownKey { .. })
    ));
}

#[test]
fn limits_taken_of_the_device_need_its_capacity() {
    for conf in ["per_process_memory_fraction:0.5", "throw_on_cudamalloc_oom:True"] {
        let e = Simulator::new(AllocatorConfig::parse(conf).unwrap(), None).unwrap_err();
        assert!(matches!(e, ConfigError::NeedsCapacity { .. }), "{conf}: {e}");
    }
    // A threshold without a fraction is accepted: PyTorch then never collects.
    assert!(Simulator::new(
        AllocatorConfig::parse("garbage_collection_threshold:0.5").unwrap(),
        None
    )
    .is_ok());
}
