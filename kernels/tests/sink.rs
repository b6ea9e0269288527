//! Block boundaries through gradient sinks against PyTorch itself: the same graph built on the
//! previous output directly (a non-leaf, as in a PyTorch model) gives the same gradients to the
//! bit and allocates, keeps and frees the same bytes. Every test takes the meter's lock.

use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::sink::{backward_edges, output_edge, sink_alias, GradSink, OutputEdge};
use ckptune_kernels::{autograd, MemoryMeter};
use tch::{Device, Kind, Tensor};

fn setup() -> MemoryMeter {
    let m = MemoryMeter::new().expect("meter installs");
    tch::set_num_threads(1);
    m
}

fn randn(shape: [i64; 2], grad: bool) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(grad)
}

/// RMSNorm's reads of its input (three: `pow`, `mul`, and the product), then a projection.
fn norm_reader(h: &Tensor, w: &Tensor) -> Tensor {
    let ms = h.pow_tensor_scalar(2).mean_dim(Some(&[-1i64][..]), true, Kind::Float);
    (h * (ms + 1e-6).rsqrt()).matmul(w)
}

/// A producer's input `x`, its weight `w`, a reader's weight and a skip reader's factor `q`.
fn weights(seed: i64) -> [Tensor; 4] {
    tch::manual_seed(seed);
    [
        randn([16, 32], true),
        randn([32, 32], true),
        randn([32, 8], true),
        randn([16, 32], false),
    ]
}

/// The producer `h = tanh(x w)` read twice, as the runtime hands each block reading it an alias:
/// a later block's skip reader (`h * q`), whose backward runs here, leaving its gradient in the
/// sink, and the next block, whose input alias is returned with the sink and the producer's edge.
fn read_twice(x: &Tensor, w: &Tensor, q: &Tensor) -> (Tensor, GradSink, OutputEdge) {
    let h = x.matmul(w).tanh();
    let (input, sink) = sink_alias(&h).unwrap();
    let skip = sink.alias(&h).unwrap();
    let edge = output_edge(h).unwrap();
    let s = &skip * q;
    drop(skip);
    let seed = s.ones_like();
    autograd::backward(s, seed).unwrap();
    (input, sink, edge)
}

/// A producer `h = tanh(x w)`, its input reader (a norm and a projection, the next block) and a
/// later block's skip reader: backward reader by reader, the skip's first, then the producer
/// from its output's edge with the sink's sum, equals one pass over the fused graph bit for bit.
#[test]
fn sink_sums_readers_as_one_fused_graph() {
    let _m = setup();
    let [x, w, w2, q] = weights(3);

    let h = x.matmul(&w).tanh();
    let r = norm_reader(&h, &w2);
    let s = &h * &q;
    let reference = Tensor::run_backward(&[&r, &s], &[&x, &w, &w2], false, false);
    drop((h, r, s));

    let (input, sink, edge) = read_twice(&x, &w, &q);
    let r = norm_reader(&input, &w2);
    drop(input);
    let seed = r.ones_like();
    backward_edges(vec![(output_edge(r).unwrap(), seed)], &[&sink]).unwrap();
    let g = sink.take_grad().unwrap();
    assert!(
        !sink.take_grad().unwrap().defined(),
        "taking the gradient empties the sink"
    );
    backward_edges(vec![(edge, g)], &[]).unwrap();
    assert!(x.grad().equal(&reference[0]), "input gradient");
    assert!(w.grad().equal(&reference[1]), "producer weight gradient");
    assert!(w2.grad().equal(&reference[2]), "reader weight gradient");
}

/// A reader handing on two tensors (`a` and `b`, both made from its input, as a `torch.export`
/// layer returning `(hidden, gate)` does) whose input a later block read too: one backward from
/// both outputs' edges, the later reader's gradient in the sink fed in first, then the producer
/// from its edge with the sink's sum, equals one pass over the fused graph bit for bit.
#[test]
fn a_backward_from_several_output_edges_equals_one_fused_pass() {
    let _m = setup();
    let [x, w, w2, q] = weights(8);
    let outputs = |h: &Tensor| {
        let p = h.matmul(&w2);
        (p.tanh(), p.sin() * &p)
    };

    let h = x.matmul(&w).tanh();
    let (a, b) = outputs(&h);
    let s = &h * &q;
    let reference = Tensor::run_backward(&[&a, &b, &s], &[&x, &w, &w2], false, false);
    drop((h, a, b, s));

    let (input, sink, edge) = read_twice(&x, &w, &q);
    let (a, b) = outputs(&input);
    drop(input);
    let (ga, gb) = (a.ones_like(), b.ones_like());
    let roots = vec![(output_edge(a).unwrap(), ga), (output_edge(b).unwrap(), gb)];
    backward_edges(roots, &[&sink]).unwrap();
    backward_edges(vec![(edge, sink.take_grad().unwrap())], &[]).unwrap();
    assert!(x.grad().equal(&reference[0]), "input gradient");
    assert!(w.grad().equal(&reference[1]), "producer weight gradient");
    assert!(w2.grad().equal(&reference[2]), "reader weight gradient");
}

/// One forward-and-backward of a producer (fp32) and a reader casting its input in three
/// bf16 projections (BERT's query, key and value) under autocast with its cache on, either on
/// the producer's output itself (PyTorch) or through a sink: the bytes kept after the reader's
/// forward (handles on the boundary dropped), the forward's peak, and the gradients.
fn qkv_step(m: &MemoryMeter, through_sink: bool) -> (i64, i64, Vec<Tensor>) {
    tch::manual_seed(5);
    let x = randn([64, 128], true);
    let w = randn([128, 128], true);
    let ws: Vec<Tensor> = (0..3).map(|_| randn([128, 128], true)).collect();
    let h = x.matmul(&w) * 0.1;
    let (out, fwd) = m.measure(|| {
        let _ac = AutocastGuard::new(Device::Cpu, Kind::BFloat16, true).unwrap();
        let (input, boundary) = if through_sink {
            let (input, sink) = sink_alias(&h).unwrap();
            (input, Some((sink, output_edge(h).unwrap())))
        } else {
            (h, None)
        };
        let y = ws
            .iter()
            .map(|w| input.matmul(w).sum(Kind::Float))
            .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b);
        (y, boundary)
    });
    let (y, boundary) = out;
    let seed = y.ones_like();
    match boundary {
        Some((sink, edge)) => {
            backward_edges(vec![(output_edge(y).unwrap(), seed)], &[&sink]).unwrap();
            backward_edges(vec![(edge, sink.take_grad().unwrap())], &[]).unwrap();
        }
        None => autograd::backward(y, seed).unwrap(),
    }
    let grads = std::iter::once(&x).chain([&w]).chain(&ws).map(|t| t.grad()).collect();
    (fwd.kept(), fwd.peak_above_start(), grads)
}

/// Autocast casts a sink's alias once per operator (it caches only leaves' casts), and the
/// boundary's fp32 storage goes when the reader's forward is done, since no reader saved it: a
/// block reads its input as a PyTorch layer reads the previous layer's output, byte for byte
/// and bit for bit.
#[test]
fn a_boundary_no_reader_saved_is_freed_as_in_pytorch() {
    let m = setup();
    let (kept_ref, peak_ref, grads_ref) = qkv_step(&m, false);
    let (kept, peak, grads) = qkv_step(&m, true);
    // What PyTorch keeps: the three projections' saved bf16 casts of the input and of their
    // weights, and the fp32 scalar sum; the fp32 input (64 × 128 × 4 B) freed.
    assert_eq!(kept_ref, 3 * (64 * 128 * 2 + 128 * 128 * 2) + 4 - 64 * 128 * 4);
    assert_eq!((kept, peak), (kept_ref, peak_ref), "bytes kept and at peak");
    for (i, (g, r)) in grads.iter().zip(&grads_ref).enumerate() {
        assert!(g.equal(r), "gradient {i}");
    }
}

/// An in-place operator may write a sink's alias in grad mode, as PyTorch lets
/// `nn.ReLU(inplace=True)` write the previous layer's output; the gradients are PyTorch's.
#[test]
fn a_reader_may_write_its_input_in_place() {
    let _m = setup();
    tch::manual_seed(7);
    let x = randn([8, 16], true);
    let w = randn([16, 16], true);
    let w2 = randn([16, 4], true);
    let reference = {
        let mut h = x.matmul(&w);
        let _ = h.relu_();
        let y = h.matmul(&w2);
        Tensor::run_backward(&[&y], &[&x, &w, &w2], false, false)
    };
    let h = x.matmul(&w);
    let (mut input, sink) = sink_alias(&h).unwrap();
    let edge = output_edge(h).unwrap();
    let _ = input.relu_();
    let y = input.matmul(&w2);
    drop(input);
    let seed = y.ones_like();
    backward_edges(vec![(output_edge(y).unwrap(), seed)], &[&sink]).unwrap();
    backward_edges(vec![(edge, sink.take_grad().unwrap())], &[]).unwrap();
    assert!(x.grad().equal(&reference[0]), "input gradient");
    assert!(w.grad().equal(&reference[1]), "producer weight gradient");
    assert!(w2.grad().equal(&reference[2]), "reader weight gradient");
}

#[test]
fn sink_errors_are_clear() {
    let _m = setup();
    let ids = Tensor::zeros([3], (Kind::Int64, Device::Cpu));
    let err = sink_alias(&ids)
        .err()
        .expect("an integer tensor has no gradient")
        .to_string();
    assert!(err.contains("floating-point"), "{err}");
    let err = output_edge(Tensor::ones([3], (Kind::Float, Device::Cpu)))
        .err()
        .expect("no graph")
        .to_string();
    assert!(err.contains("does not require grad"), "{err}");
    let (_, sink) = sink_alias(&Tensor::ones([3], (Kind::Float, Device::Cpu))).unwrap();
    let err = sink
        .alias(&Tensor::ones([4], (Kind::Float, Device::Cpu)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("must read one tensor"), "{err}");
    let y = randn([3, 1], true).exp();
    let err = backward_edges(
        vec![(output_edge(y).unwrap(), Tensor::ones([4], (Kind::Float, Device::Cpu)))],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("gradient shape"), "{err}");
}
