//! Each formula against a count by hand, and which calls of a nested trace are counted.

use super::*;

type T = Option<(Kind, Vec<i64>)>;

fn f32(shape: &[i64]) -> T {
    Some((Kind::Float, shape.to_vec()))
}

fn bf16(shape: &[i64]) -> T {
    Some((Kind::BFloat16, shape.to_vec()))
}

fn op(name: &str, inputs: Vec<T>, numbers: &[(usize, f64)], outputs: Vec<T>) -> OpEvent {
    let mut nums = vec![None; inputs.len()];
    for &(i, v) in numbers {
        nums[i] = Some(v);
    }
    OpEvent {
        name: name.into(),
        scope: false,
        depth: 0,
        end: 0,
        enter: 0,
        exit: 0,
        peak: 0,
        seconds: 0.0,
        inputs,
        numbers: nums,
        outputs,
        codes: Vec::new(),
    }
}

fn flops(e: &OpEvent) -> f64 {
    let w = work_of(e, false);
    assert!(w.engine != Engine::Memory, "{} has no FLOP formula", e.name);
    w.flops
}

#[test]
fn matrix_products_count_two_flops_per_multiply_add() {
    let mm = op(
        "aten::mm",
        vec![f32(&[64, 32]), f32(&[32, 16])],
        &[],
        vec![f32(&[64, 16])],
    );
    assert_eq!(flops(&mm), 2.0 * 64.0 * 32.0 * 16.0);
    // Bytes: both operands read, the product written.
    assert_eq!(work_of(&mm, false).bytes, ((64 * 32 + 32 * 16 + 64 * 16) * 4) as f64);
    assert_eq!(work_of(&mm, false).size, (64.0f64 * 32.0 * 16.0).cbrt());
    let addmm = op(
        "aten::addmm",
        vec![f32(&[16]), f32(&[64, 32]), f32(&[32, 16]), None, None],
        &[(3, 1.0), (4, 1.0)],
        vec![f32(&[64, 16])],
    );
    assert_eq!(flops(&addmm), 65536.0);
    let bmm = op(
        "aten::bmm",
        vec![f32(&[4, 8, 16]), f32(&[4, 16, 2])],
        &[],
        vec![f32(&[4, 8, 2])],
    );
    assert_eq!(flops(&bmm), 2.0 * 4.0 * 8.0 * 16.0 * 2.0);
    let baddbmm = op(
        "aten::baddbmm",
        vec![f32(&[4, 8, 2]), f32(&[4, 8, 16]), f32(&[4, 16, 2])],
        &[],
        vec![f32(&[4, 8, 2])],
    );
    assert_eq!(flops(&baddbmm), 2048.0);
    // matmul broadcasts its batch dimensions: [2, 1] against [3] is 6 products.
    let matmul = op(
        "aten::matmul",
        vec![f32(&[2, 1, 8, 16]), f32(&[3, 16, 4])],
        &[],
        vec![f32(&[2, 3, 8, 4])],
    );
    assert_eq!(flops(&matmul), 2.0 * 6.0 * 8.0 * 16.0 * 4.0);
    let mv = op("aten::matmul", vec![f32(&[8, 16]), f32(&[16])], &[], vec![f32(&[8])]);
    assert_eq!(flops(&mv), 2.0 * 8.0 * 16.0);
    // linear: [2, 5, 16] tokens by a [8, 16] weight.
    let linear = op(
        "aten::linear",
        vec![f32(&[2, 5, 16]), f32(&[8, 16]), f32(&[8])],
        &[],
        vec![f32(&[2, 5, 8])],
    );
    assert_eq!(flops(&linear), 2.0 * 10.0 * 16.0 * 8.0);
    // A product's thin dimension is its smaller output one: 8 columns of 10 tokens here, 2 of
    // baddbmm's [8, 2] products; a pooler's 8 rows by a 768-square weight.
    assert_eq!(work_of(&linear, false).thin, 8.0);
    assert_eq!(work_of(&baddbmm, false).thin, 2.0);
    let pooler = op(
        "aten::addmm",
        vec![f32(&[768]), f32(&[8, 768]), f32(&[768, 768])],
        &[],
        vec![f32(&[8, 768])],
    );
    assert_eq!(work_of(&pooler, false).thin, 8.0);
}

#[test]
fn convolutions_count_each_output_elements_window_per_group() {
    // 7×7 over 3 channels into 8: each of 2·8·16·16 outputs takes 3·49 multiply-adds.
    let conv = op(
        "aten::mkldnn_convolution",
        vec![f32(&[2, 3, 32, 32]), f32(&[8, 3, 7, 7]), None, None, None, None, None],
        &[(6, 1.0)],
        vec![f32(&[2, 8, 16, 16])],
    );
    assert_eq!(flops(&conv), 2.0 * (2 * 8 * 16 * 16) as f64 * 147.0);
    // Groups: 8 channels in 4 groups, each output reads 2 channels' 3×3 windows.
    let grouped = op(
        "aten::convolution",
        vec![
            f32(&[1, 8, 10, 10]),
            f32(&[8, 2, 3, 3]),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        ],
        &[(6, 0.0), (8, 4.0)],
        vec![f32(&[1, 8, 8, 8])],
    );
    assert_eq!(flops(&grouped), 2.0 * 512.0 * 18.0);
    // Transposed: weight [in 4, out/groups 2, 3, 3]; each input element scatters 2·9.
    let transposed = op(
        "aten::convolution",
        vec![
            f32(&[1, 4, 5, 5]),
            f32(&[4, 2, 3, 3]),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        ],
        &[(6, 1.0), (8, 1.0)],
        vec![f32(&[1, 2, 7, 7])],
    );
    assert_eq!(flops(&transposed), 2.0 * 100.0 * 18.0);
    // Backward: a forward's work per gradient computed (the output mask leaves the others out).
    let backward = |outputs: Vec<T>| {
        let mut inputs = vec![f32(&[2, 8, 16, 16]), f32(&[2, 3, 32, 32]), f32(&[8, 3, 7, 7])];
        inputs.extend(vec![None; 8]);
        op("aten::convolution_backward", inputs, &[(7, 0.0), (9, 1.0)], outputs)
    };
    let both = backward(vec![f32(&[2, 3, 32, 32]), f32(&[8, 3, 7, 7]), None]);
    assert_eq!(flops(&both), 2.0 * 2.0 * 4096.0 * 147.0);
    assert_eq!(work_of(&both, false).engine, Engine::ConvBackward);
    let weight_only = backward(vec![None, f32(&[8, 3, 7, 7]), f32(&[8])]);
    assert_eq!(flops(&weight_only), 2.0 * 4096.0 * 147.0);
    // A convolution has no thin dimension: its kernels tile the image.
    assert_eq!(work_of(&conv, false).thin, 0.0);
    assert_eq!(work_of(&both, false).thin, 0.0);
    // Its kernel's pixels, forward and backward, which pick the measured shapes it is timed
    // among; none for other work.
    assert_eq!(work_of(&conv, false).kernel, 49.0);
    assert_eq!(work_of(&grouped, false).kernel, 9.0);
    assert_eq!(work_of(&both, false).kernel, 49.0);
    let add = op("aten::add", vec![f32(&[4, 4]), f32(&[4, 4])], &[], vec![f32(&[4, 4])]);
    assert_eq!(work_of(&add, false).kernel, 0.0);
}

#[test]
fn attention_counts_two_products_forward_five_backward_and_halves_when_causal() {
    let (q, k, v) = (f32(&[2, 4, 16, 8]), f32(&[2, 4, 32, 8]), f32(&[2, 4, 32, 8]));
    let fwd = |causal: f64| {
        op(
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            vec![q.clone(), k.clone(), v.clone(), None, None, None, None],
            &[(3, 0.0), (4, causal)],
            vec![f32(&[2, 4, 16, 8]), Some((Kind::Float, vec![2, 4, 16]))],
        )
    };
    // 8 heads, 16 queries by 32 keys, QKᵀ over 8 and PV over 8.
    let full = 2.0 * 8.0 * 16.0 * 32.0 * 16.0;
    assert_eq!(flops(&fwd(0.0)), full);
    assert_eq!(flops(&fwd(1.0)), full / 2.0);
    let bwd = op(
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        vec![
            f32(&[2, 4, 16, 8]),
            q.clone(),
            k.clone(),
            v.clone(),
            f32(&[2, 4, 16, 8]),
            f32(&[2, 4, 16]),
            None,
            None,
            None,
            None,
        ],
        &[(6, 0.0), (7, 1.0)],
        vec![q.clone(), k.clone(), v.clone()],
    );
    assert_eq!(flops(&bwd), 2.5 * full / 2.0);
    // Their scores, masked or not: 8 heads of 16 × 32; the full products' FLOPs.
    let attention = |e: &OpEvent| work_of(e, false).attention.unwrap();
    let (f, c, b) = (attention(&fwd(0.0)), attention(&fwd(1.0)), attention(&bwd));
    assert_eq!(
        (f.scores, f.full_flops, f.causal, f.length, f.head, f.backward),
        (4096.0, full, false, 16.0, 8.0, false)
    );
    // The backward's queries come after the output's gradient: the same head size.
    assert_eq!(b.head, 8.0);
    assert_eq!((c.scores, c.full_flops, c.causal), (4096.0, full, true));
    assert_eq!(
        (b.scores, b.full_flops, b.causal, b.backward),
        (4096.0, 2.5 * full, true, true)
    );
    // Nor has attention: no weight streams through its products.
    assert_eq!(work_of(&fwd(0.0), false).thin, 0.0);
}

#[test]
fn other_operators_count_the_bytes_they_read_and_write() {
    let add = op(
        "aten::add.Tensor",
        vec![f32(&[2, 3]), f32(&[2, 3]), None],
        &[(2, 1.0)],
        vec![f32(&[2, 3])],
    );
    let w = work_of(&add, false);
    assert_eq!(
        (w.engine, w.dtype, w.flops, w.bytes),
        (Engine::Memory, Dtype::Fp32, 0.0, 72.0)
    );
    // copy_ overwrites its destination: the source read, the destination written.
    let copy = op(
        "aten::copy_",
        vec![f32(&[4]), f32(&[4]), None],
        &[(2, 0.0)],
        vec![f32(&[4])],
    );
    assert_eq!(work_of(&copy, true).bytes, 32.0);
    // add_ reads what it writes into.
    let add_ = op(
        "aten::add_.Tensor",
        vec![f32(&[4]), f32(&[4]), None],
        &[],
        vec![f32(&[4])],
    );
    assert_eq!(work_of(&add_, true).bytes, 48.0);
    // An out= argument is written, not read.
    let out = op(
        "aten::add.out",
        vec![f32(&[4]), f32(&[4]), None, f32(&[4])],
        &[],
        vec![f32(&[4])],
    );
    assert_eq!(work_of(&out, true).bytes, 48.0);
    // A gather reads the rows it returns, not its whole source: 32 rows of a 1000-row table.
    let lookup = op(
        "aten::index_select",
        vec![f32(&[1000, 8]), None, Some((Kind::Int64, vec![32]))],
        &[(1, 0.0)],
        vec![f32(&[32, 8])],
    );
    assert_eq!(work_of(&lookup, false).bytes, (32 * 8 * 4 + 32 * 8 + 32 * 8 * 4) as f64);
    // The dtype is the largest operand's: a bf16 cast of an fp32 tensor moves 6 bytes each.
    let bf = op(
        "aten::copy_",
        vec![Some((Kind::BFloat16, vec![1024])), f32(&[1024]), None],
        &[],
        vec![Some((Kind::BFloat16, vec![1024]))],
    );
    let w = work_of(&bf, true);
    assert_eq!((w.dtype, w.bytes, w.pass_bytes), (Dtype::Fp32, 6.0 * 1024.0, 0.0));
}

#[test]
fn an_addmm_copies_what_it_adds_into_its_output_first() {
    // A linear's bias: 16 fp32 read, the [64, 16] output written (each line read first).
    let addmm = op(
        "aten::addmm",
        vec![f32(&[16]), f32(&[64, 32]), f32(&[32, 16]), None, None],
        &[(3, 1.0), (4, 1.0)],
        vec![f32(&[64, 16])],
    );
    assert_eq!(work_of(&addmm, false).pass_bytes, ((16 + 2 * 64 * 16) * 4) as f64);
    // A full-size term is read whole; with beta 0 nothing is copied; mm adds nothing.
    let baddbmm = op(
        "aten::baddbmm",
        vec![bf16(&[4, 8, 2]), bf16(&[4, 8, 16]), bf16(&[4, 16, 2])],
        &[],
        vec![bf16(&[4, 8, 2])],
    );
    assert_eq!(work_of(&baddbmm, false).pass_bytes, (3 * 4 * 8 * 2 * 2) as f64);
    let ignored = op(
        "aten::addmm",
        vec![f32(&[16]), f32(&[64, 32]), f32(&[32, 16]), None, None],
        &[(3, 0.0), (4, 1.0)],
        vec![f32(&[64, 16])],
    );
    assert_eq!(work_of(&ignored, false).pass_bytes, 0.0);
    let mm = op(
        "aten::mm",
        vec![f32(&[64, 32]), f32(&[32, 16])],
        &[],
        vec![f32(&[64, 16])],
    );
    assert_eq!(work_of(&mm, false).pass_bytes, 0.0);
}

#[test]
fn elementwise_arithmetic_over_mixed_dtypes_casts_the_others_first() {
    // Autocast's residual: a bf16 branch plus an fp32 input, an fp32 sum. Its bytes are its
    // tensors' own; its pass casts the bf16 input (2 bytes read, 4 written each), which the
    // add then reads at fp32's width (2 more each): 8 bytes per element.
    let n = 8 * 128 * 768;
    let add = op(
        "aten::add.Tensor",
        vec![bf16(&[8, 128, 768]), f32(&[8, 128, 768]), None],
        &[(2, 1.0)],
        vec![f32(&[8, 128, 768])],
    );
    let w = work_of(&add, false);
    assert_eq!((w.bytes, w.pass_bytes), ((10 * n) as f64, (8 * n) as f64));
    // In place into bf16: the bf16 input cast up (8 bytes per element), the fp32 result cast
    // back (6 bytes).
    let add_ = op(
        "aten::add_.Tensor",
        vec![bf16(&[4]), f32(&[4]), None],
        &[],
        vec![bf16(&[4])],
    );
    let w = work_of(&add_, true);
    assert_eq!((w.bytes, w.pass_bytes), (32.0, 4.0 * 8.0 + 4.0 * 6.0));
    // A wrapped number (a 0-dim double) sets no width: a bf16 product by it makes no pass.
    let scaled = op(
        "aten::mul.Tensor",
        vec![bf16(&[4]), Some((Kind::Double, vec![]))],
        &[],
        vec![bf16(&[4])],
    );
    assert_eq!(work_of(&scaled, false).pass_bytes, 0.0);
    // One dtype, a mask, or an operator that is itself the cast: no pass.
    let same = op("aten::mul.Tensor", vec![bf16(&[4]), bf16(&[4])], &[], vec![bf16(&[4])]);
    let masked = op(
        "aten::where.self",
        vec![Some((Kind::Bool, vec![4])), f32(&[4]), f32(&[4])],
        &[],
        vec![f32(&[4])],
    );
    let cast = op("aten::copy_", vec![bf16(&[4]), f32(&[4]), None], &[], vec![bf16(&[4])]);
    for e in [same, masked, cast] {
        assert_eq!(work_of(&e, true).pass_bytes, 0.0, "{}", e.name);
    }
}

/// A trace from `(depth, event)`: each event's `end` closes after the deeper ones that follow.
fn nest(events: Vec<(u32, OpEvent)>) -> Vec<OpEvent> {
    let n = events.len();
    (0..n)
        .map(|i| {
            let d = events[i].0;
            let end = (i + 1..n).find(|&j| events[j].0 <= d).unwrap_or(n);
            OpEvent {
                depth: d,
                end,
                ..events[i].1.clone()
            }
        })
        .collect()
}

fn traits_of(name: &str) -> Traits {
    Traits {
        decomposition: ["aten::linear", "aten::dropout", "aten::matmul"].contains(&name),
        view: ["aten::t", "aten::transpose.int", "aten::as_strided", "aten::view"].contains(&name),
        writes_input: name.ends_with('_') || name.contains("_."),
    }
}

#[test]
fn counting_takes_each_piece_of_work_once() {
    let x = || f32(&[32, 32]);
    let scalar = || f32(&[]);
    let mut scope = op("ckptune::forward#1:layer", vec![], &[], vec![]);
    scope.scope = true;
    let trace = nest(vec![
        (0, scope),
        (0, op("aten::linear", vec![x(), x(), f32(&[32])], &[], vec![x()])),
        (1, op("aten::t", vec![x()], &[], vec![x()])),
        (2, op("aten::transpose.int", vec![x()], &[], vec![x()])),
        (3, op("aten::as_strided", vec![x()], &[], vec![x()])),
        (1, op("aten::addmm", vec![f32(&[32]), x(), x()], &[], vec![x()])),
        (0, op("aten::dropout", vec![x()], &[], vec![x()])),
        (1, op("aten::empty_like", vec![x()], &[], vec![x()])),
        (2, op("aten::empty_strided", vec![], &[], vec![x()])),
        (1, op("aten::bernoulli_.float", vec![x()], &[], vec![x()])),
        (1, op("aten::div_.Scalar", vec![x()], &[], vec![x()])),
        (2, op("aten::div_.Tensor", vec![x(), scalar()], &[], vec![x()])),
        (3, op("aten::to.dtype", vec![scalar()], &[], vec![scalar()])),
        (4, op("aten::_to_copy", vec![scalar()], &[], vec![scalar()])),
        (5, op("aten::empty_strided", vec![], &[], vec![scalar()])),
        (5, op("aten::copy_", vec![scalar(), scalar()], &[], vec![scalar()])),
        (
            0,
            op(
                "autograd::engine::evaluate_function: ConvolutionBackward0",
                vec![],
                &[],
                vec![],
            ),
        ),
        (
            1,
            op(
                "aten::convolution_backward",
                vec![f32(&[1, 4, 8, 8]), f32(&[1, 4, 8, 8]), f32(&[4, 4, 3, 3])],
                &[],
                vec![f32(&[1, 4, 8, 8]), f32(&[4, 4, 3, 3]), None],
            ),
        ),
        (
            2,
            op(
                "aten::contiguous",
                vec![f32(&[1, 4, 8, 8])],
                &[],
                vec![f32(&[1, 4, 8, 8])],
            ),
        ),
        (
            3,
            op(
                "aten::copy_",
                vec![f32(&[1, 4, 8, 8]), f32(&[1, 4, 8, 8])],
                &[],
                vec![f32(&[1, 4, 8, 8])],
            ),
        ),
        (
            0,
            op(
                "aten::max_pool2d_with_indices_backward",
                vec![f32(&[16, 16]), x()],
                &[],
                vec![x()],
            ),
        ),
        (1, op("aten::zero_", vec![x()], &[], vec![x()])),
        (0, op("aten::ones", vec![], &[], vec![x()])),
        (1, op("aten::empty.memory_format", vec![], &[], vec![x()])),
        (1, op("aten::fill_.Scalar", vec![x()], &[], vec![x()])),
        // `matmul` folding a transposed operand: its copy, then `_unsafe_view`, which returns
        // the copy under new sizes (no alias annotation, so not a view to the dispatcher).
        (0, op("aten::reshape", vec![x()], &[], vec![f32(&[1024])])),
        (1, op("aten::clone", vec![x()], &[], vec![x()])),
        (2, op("aten::copy_", vec![x(), x()], &[], vec![x()])),
        (1, op("aten::_unsafe_view", vec![x()], &[], vec![f32(&[1024])])),
    ]);
    let names: Vec<&str> = counted(&trace, &mut traits_of)
        .iter()
        .map(|c| trace[c.index].name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "aten::addmm",
            "aten::bernoulli_.float",
            "aten::copy_",
            "aten::div_.Tensor",
            "aten::convolution_backward",
            "aten::zero_",
            "aten::max_pool2d_with_indices_backward",
            "aten::fill_.Scalar",
            "aten::copy_"
        ]
    );
    // One dispatcher overhead per call the step or a node makes, and per node.
    let calls: Vec<&str> = calls(&trace).iter().map(|&i| trace[i].name.as_str()).collect();
    assert_eq!(
        calls,
        [
            "aten::linear",
            "aten::dropout",
            "autograd::engine::evaluate_function: ConvolutionBackward0",
            "aten::convolution_backward",
            "aten::max_pool2d_with_indices_backward",
            "aten::ones",
            "aten::reshape"
        ]
    );
}

#[test]
fn an_operator_that_casts_its_inputs_first_counts_as_itself_with_the_casts_as_its_pass() {
    // `bf16 + fp32` on a CPU: the bf16 input cast into an fp32 temporary, then an fp32 add.
    let cast = |depth| {
        [
            (
                depth,
                op("aten::to.dtype", vec![bf16(&[4, 8])], &[], vec![f32(&[4, 8])]),
            ),
            (
                depth + 1,
                op("aten::_to_copy", vec![bf16(&[4, 8])], &[], vec![f32(&[4, 8])]),
            ),
            (depth + 2, op("aten::empty_strided", vec![], &[], vec![f32(&[4, 8])])),
            (
                depth + 2,
                op(
                    "aten::copy_",
                    vec![f32(&[4, 8]), bf16(&[4, 8])],
                    &[],
                    vec![f32(&[4, 8])],
                ),
            ),
        ]
    };
    let add = op(
        "aten::add.Tensor",
        vec![bf16(&[4, 8]), f32(&[4, 8])],
        &[],
        vec![f32(&[4, 8])],
    );
    let trace = nest([vec![(0, add)], cast(1).to_vec(), cast(0).to_vec()].concat());
    let counted = counted(&trace, &mut traits_of);
    let names: Vec<&str> = counted.iter().map(|c| trace[c.index].name.as_str()).collect();
    assert_eq!(names, ["aten::add.Tensor", "aten::copy_"]);
    // The add with its tensors' bytes and its cast as its pass, which a GPU does not make; a
    // cast alone is its copy.
    assert_eq!(counted[0].work, work_of(&trace[0], false));
    assert_eq!(counted[0].work.pass_bytes, 2.0 * 32.0 * 4.0);
    assert_eq!(counted[1].work.bytes, 32.0 * 6.0);
}

#[test]
fn calls_replayed_from_a_selective_cache_do_no_work_nor_does_what_they_ran_inside() {
    let x = || f32(&[32, 32]);
    let trace = nest(vec![
        (0, op("aten::linear", vec![x(), x(), f32(&[32])], &[], vec![x()])),
        (1, op("aten::t", vec![x()], &[], vec![x()])),
        (1, op("aten::addmm", vec![f32(&[32]), x(), x()], &[], vec![x()])),
        (0, op("aten::matmul", vec![x(), x()], &[], vec![x()])),
        (1, op("aten::clone", vec![x()], &[], vec![x()])),
        (1, op("aten::mm", vec![x(), x()], &[], vec![x()])),
        // A product with a formula of its own that reaches the kernels: its formula's work is
        // the replayed part's.
        (0, op("aten::mkldnn_linear", vec![x(), x()], &[], vec![x()])),
        (1, op("aten::mm", vec![x(), x()], &[], vec![x()])),
        (1, op("aten::clone", vec![x()], &[], vec![x()])),
        (
            0,
            op(
                "aten::bmm",
                vec![f32(&[2, 32, 32]), f32(&[2, 32, 32])],
                &[],
                vec![f32(&[2, 32, 32])],
            ),
        ),
    ]);
    let names =
        |c: &[Counted]| -> Vec<(usize, String)> { c.iter().map(|c| (c.index, trace[c.index].name.clone())).collect() };
    let all = counted(&trace, &mut traits_of);
    assert_eq!(
        names(&all),
        [
            (2, "aten::addmm"),
            (4, "aten::clone"),
            (5, "aten::mm"),
            (6, "aten::mkldnn_linear"),
            (9, "aten::bmm")
        ]
        .map(|(i, n)| (i, n.to_owned()))
    );
    // Nothing replayed: the same count.
    assert_eq!(counted_except(&trace, &[false; 10], &mut traits_of), all);
    let mut replayed = [false; 10];
    for i in [2, 5, 7, 9] {
        replayed[i] = true;
    }
    let left = counted_except(&trace, &replayed, &mut traits_of);
    assert_eq!(
        names(&left),
        [(4, "aten::clone"), (8, "aten::clone")].map(|(i, n)| (i, n.to_owned()))
    );
    assert_eq!(left[0].work, work_of(&trace[4], false));
}

#[test]
fn a_product_whose_first_operand_is_stored_transposed_is_marked_from_its_strides() {
    // Each tensor as the shim codes it: dtype (6: fp32), rank, sizes, strides.
    let transposed = |name: &str, inputs: &[&[i64]], codes: &[i64]| {
        let mut e = op(name, inputs.iter().map(|s| f32(s)).collect(), &[], Vec::new());
        e.codes = codes.to_vec();
        work_of(&e, false).lhs_transposed
    };
    // `x.t() @ g`, a weight's gradient: x `[16, 32]` stored row-major, read as `[32, 16]`.
    let mm: &[&[i64]] = &[&[32, 16], &[16, 64]];
    assert!(transposed("aten::mm", mm, &[6, 2, 32, 16, 1, 32, 6, 2, 16, 64, 64, 1]));
    // Only the first operand's layout counts.
    assert!(!transposed("aten::mm", mm, &[6, 2, 32, 16, 16, 1, 6, 2, 16, 64, 1, 16]));
    // addmm's first argument is what it adds: its product's first operand is the second.
    let addmm: &[&[i64]] = &[&[64], &[32, 16], &[16, 64]];
    let codes = [6, 1, 64, 1, 6, 2, 32, 16, 1, 32, 6, 2, 16, 64, 64, 1];
    assert!(transposed("aten::addmm", addmm, &codes));
    // A batch of matrices, each transposed.
    let bmm: &[&[i64]] = &[&[4, 32, 16], &[4, 16, 64]];
    let codes = [6, 3, 4, 32, 16, 512, 1, 32, 6, 3, 4, 16, 64, 1024, 64, 1];
    assert!(transposed("aten::bmm", bmm, &codes));
    // A single row has no layout to reorder.
    let row: &[&[i64]] = &[&[1, 16], &[16, 64]];
    assert!(!transposed("aten::mm", row, &[6, 2, 1, 16, 1, 1, 6, 2, 16, 64, 64, 1]));
}

#[test]
fn a_convolution_pays_a_setup_where_pytorch_runs_it_through_onednn() {
    // PyTorch itself is the reference: a forward through oneDNN calls `mkldnn_convolution`.
    // fp32 only: whether bf16 has oneDNN's kernels depends on the CPU.
    use tch::Tensor;
    let _lock = ckptune_kernels::meter::exclusive();
    ckptune_kernels::meter::install().unwrap();
    let before = tch::get_num_threads();
    // (input, weight, stride, groups); no padding. The first is the calibration's setup probe.
    let cases: [(&[i64], &[i64], i64, i64); 12] = [
        (&[2, 1, 2, 2], &[1, 1, 1, 1], 2, 1),
        (&[8, 8, 8, 8], &[16, 8, 3, 3], 1, 1),
        (&[8, 8, 8, 8], &[16, 8, 1, 1], 1, 1),
        (&[8, 8, 8, 8], &[16, 8, 1, 1], 2, 1),
        (&[16, 8, 4, 4], &[16, 8, 1, 1], 1, 1),
        (&[1, 4, 8, 8], &[8, 4, 3, 3], 1, 1),
        (&[1, 8, 64, 64], &[8, 8, 3, 3], 1, 1),
        (&[1, 8, 8, 8], &[8, 2, 3, 3], 1, 4),
        (&[1, 2, 8, 8], &[4, 2, 5, 5], 1, 1),
        (&[1, 2, 8, 8], &[4, 2, 5, 5], 2, 1),
        (&[4, 3, 16], &[6, 3, 3], 1, 1),
        (&[4, 3, 16], &[6, 3, 1], 1, 1),
    ];
    let mut seen = [0; 2];
    for threads in [1, 2] {
        tch::set_num_threads(threads);
        for (input, weight, stride, groups) in cases {
            let x = Tensor::randn(input, (Kind::Float, tch::Device::Cpu));
            let w = Tensor::randn(weight, (Kind::Float, tch::Device::Cpu));
            optrace::start().unwrap();
            let _y = if input.len() == 3 {
                x.conv1d(&w, None::<&Tensor>, [stride], [0], [1], groups)
            } else {
                x.conv2d(&w, None::<&Tensor>, [stride, stride], [0, 0], [1, 1], groups)
            };
            let events = optrace::stop().unwrap();
            let onednn = events.iter().any(|e| e.name.contains("mkldnn_convolution"));
            let c = counted(&events, &mut traits);
            assert_eq!(c.len(), 1, "{input:?} by {weight:?}: {events:?}");
            let setup = c[0].work.setup;
            assert_eq!(
                setup.applies(Some(threads)),
                onednn,
                "{input:?} by {weight:?}, stride {stride}, groups {groups}, {threads} threads: {setup:?}"
            );
            seen[usize::from(onednn)] += 1;
        }
    }
    tch::set_num_threads(before);
    // Both backends were met.
    assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
    // bf16 always; a backward by the forward's rule, from its input, weight and output gradient.
    assert_eq!(
        conv_setup(Dtype::Bf16, &[1, 4, 8, 8], &[8, 4, 3, 3], &[1, 8, 6, 6], false),
        Setup::Always
    );
    let backward = op(
        "aten::convolution_backward",
        vec![f32(&[8, 16, 8, 8]), f32(&[8, 8, 8, 8]), f32(&[16, 8, 1, 1])],
        &[],
        vec![f32(&[8, 8, 8, 8]), f32(&[16, 8, 1, 1])],
    );
    assert_eq!(work_of(&backward, false).setup, Setup::Threaded);
}

#[test]
fn an_operator_computes_in_its_largest_floating_tensors_dtype_never_an_indexs() {
    let i64s = |shape: &[i64]| Some((Kind::Int64, shape.to_vec()));
    // ResNet's max pooling under bf16 autocast: its int64 indices hold as many bytes as its input.
    let (input, pooled) = ([8, 64, 112, 112], [8, 64, 56, 56]);
    let forward = op(
        "aten::max_pool2d_with_indices",
        vec![bf16(&input)],
        &[],
        vec![bf16(&pooled), i64s(&pooled)],
    );
    let backward = op(
        "aten::max_pool2d_with_indices_backward",
        vec![bf16(&pooled), bf16(&input), i64s(&pooled)],
        &[],
        vec![bf16(&input)],
    );
    for e in [&forward, &backward] {
        assert_eq!(work_of(e, false).dtype, Dtype::Bf16, "{}", e.name);
    }
    // With no floating-point tensor at all, fp32's rates.
    let arange = op("aten::arange", vec![], &[], vec![i64s(&[1024])]);
    assert_eq!(work_of(&arange, false).dtype, Dtype::Fp32);
}
