//! ResNet as torchvision's `torchvision/models/resnet.py` builds it (ResNet v1.5: the stride
//! of a downsampling Bottleneck is on its 3x3 `conv2`), as a chain of named blocks.
//!
//! Names, shapes, dtypes, initialisation and the op sequence of every `forward` follow the
//! reference, in-place ReLUs and `out += identity` included: the in-place ops only ever
//! touch a block's own intermediates, never its input, so they are safe at the runtime's
//! detached block boundaries and allocate exactly what torchvision allocates. Python locals
//! are mirrored too (a reassignment frees the old value at the same point), so transient
//! memory matches in grad and no-grad mode.
//!
//! Chain: `conv1+bn1+relu+maxpool` (stem), `layer1`..`layer4` (or, at
//! [`Granularity::Block`], every residual block `layer1.0`, `layer1.1`, …; at
//! [`Granularity::Nested`], the residual blocks with each stage a [`ChainGroup`] over its
//! blocks), `avgpool+fc` (head). The stem and the head are several top-level modules run as
//! one block and are not candidates: neither is one PyTorch module, and checkpointing the
//! head would save nothing.

use tch::{nn, Tensor};

use crate::chain::{Batch, Block, Chain, ChainBlock, ChainGroup, Ctx, InputSpec, LossHead};
use crate::error::{ModelError, Result};
use crate::layers::{BatchNorm2d, Conv2d, Init, Linear, Spec};
use crate::options::{Granularity, ModelOptions};

/// torchvision's `block` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// `BasicBlock` (expansion 1): ResNet-18/34.
    Basic,
    /// `Bottleneck` (expansion 4): ResNet-50/101/152.
    Bottleneck,
}

impl BlockKind {
    pub fn expansion(self) -> i64 {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// The arguments of torchvision's `ResNet.__init__`, plus `inplanes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub block: BlockKind,
    /// Residual blocks per stage (`layers`).
    pub layers: [i64; 4],
    pub num_classes: i64,
    /// Zero-initialise the last BatchNorm weight of each residual branch.
    pub zero_init_residual: bool,
    pub groups: i64,
    pub width_per_group: i64,
    /// Channels of the stem and `planes` of `layer1` (stage k has `inplanes << k` planes).
    /// torchvision hard-codes 64 (`self.inplanes = 64`); smaller values give test models.
    pub inplanes: i64,
}

/// Default square image side.
pub const DEFAULT_IMAGE: i64 = 224;

impl Config {
    fn torchvision(block: BlockKind, layers: [i64; 4]) -> Self {
        Config {
            block,
            layers,
            num_classes: 1000,
            zero_init_residual: false,
            groups: 1,
            width_per_group: 64,
            inplanes: 64,
        }
    }

    pub fn resnet18() -> Self {
        Self::torchvision(BlockKind::Basic, [2, 2, 2, 2])
    }

    pub fn resnet34() -> Self {
        Self::torchvision(BlockKind::Basic, [3, 4, 6, 3])
    }

    pub fn resnet50() -> Self {
        Self::torchvision(BlockKind::Bottleneck, [3, 4, 6, 3])
    }

    pub fn resnet101() -> Self {
        Self::torchvision(BlockKind::Bottleneck, [3, 4, 23, 3])
    }

    pub fn resnet152() -> Self {
        Self::torchvision(BlockKind::Bottleneck, [3, 8, 36, 3])
    }

    /// A test model: BasicBlock, one block per stage, 8 stem channels, 10 classes.
    pub fn tiny() -> Self {
        Config {
            num_classes: 10,
            inplanes: 8,
            ..Self::torchvision(BlockKind::Basic, [1, 1, 1, 1])
        }
    }

    /// The torchvision name of this configuration (`resnet50`), if it is one.
    pub fn torchvision_name(&self) -> Option<&'static str> {
        let standard = self.inplanes == 64 && self.groups == 1 && self.width_per_group == 64;
        match (standard, self.block, self.layers) {
            (true, BlockKind::Basic, [2, 2, 2, 2]) => Some("resnet18"),
            (true, BlockKind::Basic, [3, 4, 6, 3]) => Some("resnet34"),
            (true, BlockKind::Bottleneck, [3, 4, 6, 3]) => Some("resnet50"),
            (true, BlockKind::Bottleneck, [3, 4, 23, 3]) => Some("resnet101"),
            (true, BlockKind::Bottleneck, [3, 8, 36, 3]) => Some("resnet152"),
            _ => None,
        }
    }

    /// A short description for messages: the torchvision name or the explicit shape.
    pub fn describe(&self) -> String {
        match self.torchvision_name() {
            Some(name) => name.to_string(),
            None => format!(
                "ResNet({:?}, layers {:?}, inplanes {}, groups {}, width_per_group {})",
                self.block, self.layers, self.inplanes, self.groups, self.width_per_group
            ),
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(ModelError::InvalidConfig {
                model: self.describe(),
                what,
            })
        };
        if self.layers.iter().any(|&n| n < 1) {
            return bad(format!(
                "every stage needs at least one block, got layers {:?}",
                self.layers
            ));
        }
        if self.num_classes < 1 || self.inplanes < 1 || self.groups < 1 || self.width_per_group < 1 {
            return bad(format!(
                "num_classes {}, inplanes {}, groups {} and width_per_group {} must be positive",
                self.num_classes, self.inplanes, self.groups, self.width_per_group
            ));
        }
        if self.block == BlockKind::Basic && (self.groups != 1 || self.width_per_group != 64) {
            return bad(format!(
                "BasicBlock only supports groups=1 and base_width=64, got groups {} and width_per_group {}",
                self.groups, self.width_per_group
            ));
        }
        Ok(())
    }

    /// `planes` of stage `k` (0-based).
    fn planes(&self, k: usize) -> i64 {
        self.inplanes << k
    }

    /// Bottleneck inner width: `int(planes * (base_width / 64.)) * groups`.
    fn width(&self, planes: i64) -> i64 {
        (planes * self.width_per_group / 64) * self.groups
    }

    /// Channels of `layer4`'s output, the input of `fc`.
    pub fn features(&self) -> i64 {
        self.planes(3) * self.block.expansion()
    }

    /// Parameter count of the torchvision model, from the architecture alone.
    pub fn param_count(&self) -> i64 {
        let bn = |c: i64| 2 * c;
        let mut total = 3 * self.inplanes * 49 + bn(self.inplanes);
        let mut inplanes = self.inplanes;
        for (k, &blocks) in self.layers.iter().enumerate() {
            let planes = self.planes(k);
            let out = planes * self.block.expansion();
            let stride = if k == 0 { 1 } else { 2 };
            if stride != 1 || inplanes != out {
                total += inplanes * out + bn(out);
            }
            for b in 0..blocks {
                let cin = if b == 0 { inplanes } else { out };
                total += match self.block {
                    BlockKind::Basic => cin * planes * 9 + bn(planes) + planes * planes * 9 + bn(planes),
                    BlockKind::Bottleneck => {
                        let w = self.width(planes);
                        cin * w + bn(w) + w * (w / self.groups) * 9 + bn(w) + w * out + bn(out)
                    }
                };
            }
            inplanes = out;
        }
        total + self.features() * self.num_classes + self.num_classes
    }

    /// Chain block names at the given granularity, in execution order.
    pub fn block_names(&self, granularity: Granularity) -> Vec<String> {
        let mut names = vec![STEM.to_string()];
        for (k, &blocks) in self.layers.iter().enumerate() {
            match granularity {
                Granularity::Layer => names.push(format!("layer{}", k + 1)),
                Granularity::Block | Granularity::Nested => {
                    names.extend((0..blocks).map(|b| format!("layer{}.{b}", k + 1)))
                }
            }
        }
        names.push(HEAD.to_string());
        names
    }

    /// Every `named_modules()` name of the torchvision model, in its order.
    pub fn module_names(&self) -> Vec<String> {
        let mut names: Vec<String> = ["conv1", "bn1", "relu", "maxpool"].map(String::from).into();
        let mut inplanes = self.inplanes;
        for (k, &blocks) in self.layers.iter().enumerate() {
            let out = self.planes(k) * self.block.expansion();
            let layer = format!("layer{}", k + 1);
            names.push(layer.clone());
            for b in 0..blocks {
                let p = format!("{layer}.{b}");
                names.push(p.clone());
                let subs: &[&str] = match self.block {
                    BlockKind::Basic => &["conv1", "bn1", "relu", "conv2", "bn2"],
                    BlockKind::Bottleneck => &["conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "relu"],
                };
                names.extend(subs.iter().map(|s| format!("{p}.{s}")));
                if b == 0 && (k != 0 || inplanes != out) {
                    names.extend(["downsample", "downsample.0", "downsample.1"].map(|s| format!("{p}.{s}")));
                }
            }
            inplanes = out;
        }
        names.extend(["avgpool", "fc"].map(String::from));
        names
    }
}

const STEM: &str = "conv1+bn1+relu+maxpool";
const HEAD: &str = "avgpool+fc";

/// torchvision's `downsample = nn.Sequential(conv1x1(inplanes, planes * expansion, stride), norm_layer(...))`.
struct Downsample {
    conv: Conv2d,
    bn: BatchNorm2d,
}

impl Downsample {
    fn forward(&self, xs: &Tensor, train: bool) -> Tensor {
        // nn.Sequential.forward: `input = module(input)`.
        let mut input = self.conv.forward(xs);
        input = self.bn.forward(&input, train);
        input
    }
}

/// `BasicBlock` or `Bottleneck` (`conv3`/`bn3` present).
struct Residual {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    conv2: Conv2d,
    bn2: BatchNorm2d,
    conv3: Option<(Conv2d, BatchNorm2d)>,
    downsample: Option<Downsample>,
}

impl Residual {
    fn new(p: &nn::Path<'_>, cfg: &Config, inplanes: i64, planes: i64, stride: i64, spec: Spec) -> Result<Self> {
        let out = planes * cfg.block.expansion();
        let last_bn = if cfg.zero_init_residual {
            Init::Zeros
        } else {
            Init::Ones
        };
        let downsample = if stride != 1 || inplanes != out {
            let d = p / "downsample";
            Some(Downsample {
                conv: Conv2d::new(&(&d / "0"), inplanes, out, 1, stride, 0, 1, spec)?,
                bn: BatchNorm2d::new(&(&d / "1"), out, Init::Ones, spec)?,
            })
        } else {
            None
        };
        match cfg.block {
            BlockKind::Basic => Ok(Residual {
                conv1: Conv2d::new(&(p / "conv1"), inplanes, planes, 3, stride, 1, 1, spec)?,
                bn1: BatchNorm2d::new(&(p / "bn1"), planes, Init::Ones, spec)?,
                conv2: Conv2d::new(&(p / "conv2"), planes, planes, 3, 1, 1, 1, spec)?,
                bn2: BatchNorm2d::new(&(p / "bn2"), planes, last_bn, spec)?,
                conv3: None,
                downsample,
            }),
            BlockKind::Bottleneck => {
                let width = cfg.width(planes);
                Ok(Residual {
                    conv1: Conv2d::new(&(p / "conv1"), inplanes, width, 1, 1, 0, 1, spec)?,
                    bn1: BatchNorm2d::new(&(p / "bn1"), width, Init::Ones, spec)?,
                    conv2: Conv2d::new(&(p / "conv2"), width, width, 3, stride, 1, cfg.groups, spec)?,
                    bn2: BatchNorm2d::new(&(p / "bn2"), width, Init::Ones, spec)?,
                    conv3: Some((
                        Conv2d::new(&(p / "conv3"), width, out, 1, 1, 0, 1, spec)?,
                        BatchNorm2d::new(&(p / "bn3"), out, last_bn, spec)?,
                    )),
                    downsample,
                })
            }
        }
    }

    /// `BasicBlock.forward` / `Bottleneck.forward`, statement for statement.
    fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        let mut out = self.conv1.forward(x);
        out = self.bn1.forward(&out, train);
        let _ = out.relu_();

        out = self.conv2.forward(&out);
        out = self.bn2.forward(&out, train);
        if let Some((conv3, bn3)) = &self.conv3 {
            let _ = out.relu_();
            out = conv3.forward(&out);
            out = bn3.forward(&out, train);
        }

        // `identity = x` unless downsampled; either way `x` itself is never written.
        let downsampled = self.downsample.as_ref().map(|d| d.forward(x, train));
        let identity = downsampled.as_ref().unwrap_or(x);
        let _ = out.g_add_(identity);
        let _ = out.relu_();
        out
    }
}

/// A run of residual blocks: a whole `layerK` (`nn.Sequential`) or one block of it.
struct Stage {
    blocks: Vec<Residual>,
}

impl Block for Stage {
    fn forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        // nn.Sequential.forward: `input = module(input)`.
        let (first, rest) = self.blocks.split_first().expect("a stage has at least one block");
        let mut input = first.forward(xs, ctx.train);
        for block in rest {
            input = block.forward(&input, ctx.train);
        }
        input
    }
}

/// `conv1`, `bn1`, `relu`, `maxpool` of `ResNet._forward_impl`.
struct Stem {
    conv1: Conv2d,
    bn1: BatchNorm2d,
}

impl Block for Stem {
    fn forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let mut x = self.conv1.forward(xs);
        x = self.bn1.forward(&x, ctx.train);
        let _ = x.relu_();
        x = x.max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false);
        x
    }
}

/// `avgpool`, `torch.flatten(x, 1)`, `fc`.
struct Head {
    fc: Linear,
}

impl Block for Head {
    fn forward(&self, xs: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        let mut x = xs.adaptive_avg_pool2d([1, 1]);
        x = x.flatten(1, -1);
        x = self.fc.forward(&x);
        x
    }
}

/// `nn.CrossEntropyLoss()(logits, target)`: mean over the batch.
pub(crate) struct CrossEntropy;

impl LossHead for CrossEntropy {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Tensor {
        output.cross_entropy_loss(&batch.target, None::<&Tensor>, tch::Reduction::Mean, -100, 0.0)
    }
}

/// Builds `cfg` as a chain named `name` for images of `opts.image` (default 224).
pub fn build(name: &str, cfg: &Config, opts: &ModelOptions) -> Result<Chain> {
    build_with_default_image(name, cfg, opts, DEFAULT_IMAGE)
}

pub(crate) fn build_with_default_image(
    name: &str,
    cfg: &Config,
    opts: &ModelOptions,
    default_image: i64,
) -> Result<Chain> {
    opts.reject(name, "seq", opts.seq, "ResNet takes images; use --image")?;
    opts.reject(name, "heads", opts.heads, "ResNet has no attention")?;
    opts.reject(
        name,
        "attention",
        opts.attention.map(|a| a.hf_name()),
        "ResNet has no attention",
    )?;
    let spec = opts.spec(name)?;
    let mut cfg = cfg.clone();
    if let Some(classes) = opts.classes {
        cfg.num_classes = classes;
    }
    cfg.validate()?;
    let image = opts.image.unwrap_or(default_image);
    if image < 1 {
        return Err(ModelError::InvalidOption {
            model: name.to_string(),
            option: "image",
            value: image.to_string(),
            why: "the image side must be at least 1 pixel".into(),
        });
    }

    let vs = nn::VarStore::new(spec.device);
    let root = vs.root();
    let stem = Stem {
        conv1: Conv2d::new(&(&root / "conv1"), 3, cfg.inplanes, 7, 2, 3, 1, spec)?,
        bn1: BatchNorm2d::new(&(&root / "bn1"), cfg.inplanes, Init::Ones, spec)?,
    };
    let mut blocks = vec![ChainBlock {
        extra_reads: Vec::new(),
        name: STEM.into(),
        candidate: false,
        skips: Vec::new(),
        block: Box::new(stem),
    }];
    let mut inplanes = cfg.inplanes;
    let mut groups = Vec::new();
    for (k, &n) in cfg.layers.iter().enumerate() {
        let layer = format!("layer{}", k + 1);
        let planes = cfg.planes(k);
        let mut residuals = Vec::with_capacity(n as usize);
        for b in 0..n {
            let stride = if k > 0 && b == 0 { 2 } else { 1 };
            let cin = if b == 0 {
                inplanes
            } else {
                planes * cfg.block.expansion()
            };
            residuals.push(Residual::new(
                &(&root / layer.as_str() / b),
                &cfg,
                cin,
                planes,
                stride,
                spec,
            )?);
        }
        inplanes = planes * cfg.block.expansion();
        match opts.granularity {
            Granularity::Layer => blocks.push(ChainBlock {
                extra_reads: Vec::new(),
                name: layer,
                candidate: true,
                skips: Vec::new(),
                block: Box::new(Stage { blocks: residuals }),
            }),
            Granularity::Block | Granularity::Nested => {
                let first = blocks.len();
                let n = residuals.len();
                blocks.extend(
                    residuals.into_iter().enumerate().map(|(b, r)| {
                        ChainBlock::new(format!("{layer}.{b}"), true, Box::new(Stage { blocks: vec![r] }))
                    }),
                );
                // A stage of one residual block is that block: nothing to nest.
                if opts.granularity == Granularity::Nested && n > 1 {
                    groups.push(ChainGroup {
                        name: layer,
                        first,
                        last: first + n - 1,
                    });
                }
            }
        }
    }
    let fc = Linear::torch_default(&(&root / "fc"), cfg.features(), cfg.num_classes, spec)?;
    blocks.push(ChainBlock {
        extra_reads: Vec::new(),
        name: HEAD.into(),
        candidate: false,
        skips: Vec::new(),
        block: Box::new(Head { fc }),
    });

    Ok(Chain {
        name: name.to_string(),
        vs,
        blocks,
        groups,
        head: Box::new(CrossEntropy),
        modules: cfg.module_names(),
        input: InputSpec::Image {
            channels: 3,
            size: image,
            classes: cfg.num_classes,
        },
        reference_params: cfg.param_count(),
        attention: None,
        shared: None,
    })
}

pub fn resnet18(opts: &ModelOptions) -> Result<Chain> {
    build("resnet18", &Config::resnet18(), opts)
}

pub fn resnet34(opts: &ModelOptions) -> Result<Chain> {
    build("resnet34", &Config::resnet34(), opts)
}

pub fn resnet50(opts: &ModelOptions) -> Result<Chain> {
    build("resnet50", &Config::resnet50(), opts)
}

pub fn resnet101(opts: &ModelOptions) -> Result<Chain> {
    build("resnet101", &Config::resnet101(), opts)
}

pub fn resnet152(opts: &ModelOptions) -> Result<Chain> {
    build("resnet152", &Config::resnet152(), opts)
}

/// [`Config::tiny`] on 16x16 images unless `opts.image` says otherwise.
pub fn tiny(opts: &ModelOptions) -> Result<Chain> {
    build_with_default_image("tiny-resnet", &Config::tiny(), opts, 16)
}
