//! The GPU table: every GPU's rates complete, its figures as published.

use super::*;
use crate::rates::tests::conv_work;
use crate::rates::Engine;

#[test]
fn every_gpu_of_the_table_gives_complete_rates_and_tensor_cores_beat_fp32() {
    for g in GPUS {
        let r = g.rates();
        assert_eq!(r.check(), Ok(()), "{}", g.key);
        assert!(!r.measured && r.source.contains(g.source), "{}", g.key);
        let work = |dtype| conv_work(Engine::Matmul, dtype, 1e12, [4096.0; 3], 0.0);
        assert!(
            r.seconds(&work(Dtype::Bf16)) < r.seconds(&work(Dtype::Fp32)),
            "{}",
            g.key
        );
        assert_eq!(gpu(&g.key.to_uppercase()), Some(g));
    }
    assert_eq!(gpu_names(), ["h100", "h200", "a100-80gb", "l40s", "rtx4090"]);
    assert!(gpu("v100").is_none());
    // The H100's figures as the datasheet states them, sparsity halved.
    let h100 = gpu("h100").unwrap().rates();
    let bf16 = h100.matmul.iter().find(|c| c.dtype == "bf16").unwrap();
    assert!((bf16.at(1.0).unwrap() - 989.4e12 * 0.7).abs() < 1e3);
}
