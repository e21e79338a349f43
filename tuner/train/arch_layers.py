"""Training shapes from real architectures: `python -m tuner.train.arch_layers` writes
quantized_models/data/arch_layers.toml, which the collector (`python -m tuner.collect`) tunes beside its synthetic
shapes.

Synthetic shapes span the kernels' ranges at random; real layers cluster (channel counts of 16·2^k, 3x3 stems on
RGB, FC layers at M=1, 1x1 convs with wide K at 7x7 and 14x14, 10 ms speech frames), and a model that saw only
random shapes proposed poorly on them (issue #24). Each family below is written from its paper's layer table, its
shapes derived here rather than typed, so a table can be checked against the paper. The families that
bench/real_layers.toml holds out (MobileNetV3, EfficientNet, ResNet-50, YOLOv5, MLPerf Tiny / CIFAR ResNets, DS-CNN-M,
Res8's residual convs, Whisper base, wav2vec 2.0, ECAPA-TDNN, TC-ResNet beyond block 1, RNNoise, the DCASE CRNN,
NSNet2, YAMNet/VGGish, PANNs, Whisper large-v3, openWakeWord) are absent; tests/test_real_layers.py checks that no
shape of one is here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

from kernels.registry import all_specs
from kernels.workload_files import WorkloadEntry, dumps

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "quantized_models" / "data" / "arch_layers.toml"
HELDOUT = ROOT / "bench" / "real_layers.toml"  # the bench's held-out real layers: never a training shape
MAX_MFLOP = 120.0  # a layer beyond this costs the collector seconds per config; real edge layers mostly are below

Layer = tuple[str, str, dict, str]  # (kernel, name, shape, source)


def _div8(c: float) -> int:
    """Channel count rounded as MobileNet's make_divisible does (to 8, never 10% below)."""
    v = max(8, int(c + 4) // 8 * 8)
    return v + 8 if v < 0.9 * c else v


def _out(n: int, s: int) -> int:
    return (n - 1) // s + 1


def _pw(name: str, hw: int, cin: int, cout: int, src: str) -> Layer:
    return ("gemm", name, {"M": hw * hw, "N": cout, "K": cin}, src)


def _dw(name: str, hw: int, c: int, s: int, src: str) -> Layer:
    return ("dwconv_3x3", name, {"H": hw, "W": hw, "C": c, "stride": s}, src)


def _c3(name: str, h: int, w: int, cin: int, cout: int, s: int, src: str) -> Layer:
    return ("conv2d_3x3", name, {"H": h, "W": w, "Cin": cin, "Cout": cout, "stride": s}, src)


def _c1(name: str, t: int, cin: int, cout: int, k: int, src: str, s: int = 1) -> Layer:
    return ("conv1d", name, {"T": t, "Cin": cin, "Cout": cout, "K": k, "stride": s}, src)


# ---- vision ------------------------------------------------------------------------------------------------

def mobilenet_v1(alpha: float, res: int) -> Iterator[Layer]:
    """Howard et al. 2017, Table 1: a 3x3 s2 stem, then 13 depthwise-separable blocks, an FC."""
    tag, src = f"mobilenetv1_{alpha}_{res}", f"MobileNetV1 {alpha} at {res} (Howard et al. 2017, Table 1)"
    c = _div8(32 * alpha)
    hw = _out(res, 2)
    yield _c3(f"{tag}.stem", res, res, 3, c, 2, src)
    plan = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 + [(1024, 2), (1024, 1)]
    for i, (out, s) in enumerate(plan, 1):
        o = _div8(out * alpha)
        yield _dw(f"{tag}.b{i}.dw", hw, c, s, src)
        hw = _out(hw, s)
        yield _pw(f"{tag}.b{i}.pw", hw, c, o, src)
        c = o
    yield ("gemm", f"{tag}.fc", {"M": 1, "N": 1000, "K": c}, src)


def mobilenet_v2(alpha: float, res: int) -> Iterator[Layer]:
    """Sandler et al. 2018, Table 2: (t, c, n, s) inverted residuals after a 3x3 s2 stem of 32."""
    tag, src = f"mobilenetv2_{alpha}_{res}", f"MobileNetV2 {alpha} at {res} (Sandler et al. 2018, Table 2)"
    c = _div8(32 * alpha)
    hw = _out(res, 2)
    yield _c3(f"{tag}.stem", res, res, 3, c, 2, src)
    b = 0
    for t, ch, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                        (6, 320, 1, 1)]:
        o = _div8(ch * alpha)
        for i in range(n):
            b += 1
            st = s if i == 0 else 1
            e = c * t
            if t != 1:
                yield _pw(f"{tag}.b{b}.expand", hw, c, e, src)
            yield _dw(f"{tag}.b{b}.dw", hw, e, st, src)
            hw = _out(hw, st)
            yield _pw(f"{tag}.b{b}.project", hw, e, o, src)
            c = o
    last = max(1280, _div8(1280 * alpha))
    yield _pw(f"{tag}.head", hw, c, last, src)
    yield ("gemm", f"{tag}.fc", {"M": 1, "N": 1000, "K": last}, src)


def shufflenet_v2(width: str) -> Iterator[Layer]:
    """Ma et al. 2018, Table 5 (224): stage outputs per width; units split channels in half."""
    outs = {"0.5": (48, 96, 192), "1.0": (116, 232, 464), "1.5": (176, 352, 704)}[width]
    tag, src = f"shufflenetv2_{width}", f"ShuffleNetV2 {width}x at 224 (Ma et al. 2018, Table 5)"
    yield _c3(f"{tag}.conv1", 224, 224, 3, 24, 2, src)
    c, hw = 24, 56
    for st, (out, n) in enumerate(zip(outs, (4, 8, 4)), 2):
        half = out // 2
        yield _dw(f"{tag}.s{st}.down.b1.dw", hw, c, 2, src)
        yield _pw(f"{tag}.s{st}.down.b1.pw", hw // 2, c, half, src)
        yield _pw(f"{tag}.s{st}.down.b2.pw1", hw, c, half, src)
        yield _dw(f"{tag}.s{st}.down.b2.dw", hw, half, 2, src)
        hw //= 2
        yield _pw(f"{tag}.s{st}.unit.pw", hw, half, half, src)
        yield _dw(f"{tag}.s{st}.unit.dw", hw, half, 1, src)
        c = out
    yield _pw(f"{tag}.conv5", hw, c, 1024, src)


def squeezenet_11() -> Iterator[Layer]:
    """Iandola et al. 2016, SqueezeNet 1.1 (224): fire modules (squeeze 1x1, expand 1x1 + 3x3)."""
    src = "SqueezeNet 1.1 at 224 (Iandola et al. 2016; v1.1 stem)"
    yield _c3("squeezenet1_1.conv1", 224, 224, 3, 64, 2, src)
    for i, (hw, cin, s, e) in enumerate([(56, 64, 16, 64), (56, 128, 16, 64), (28, 128, 32, 128), (28, 256, 32, 128),
                                         (14, 256, 48, 192), (14, 384, 48, 192), (14, 384, 64, 256),
                                         (14, 512, 64, 256)], 2):
        yield _pw(f"squeezenet1_1.fire{i}.squeeze", hw, cin, s, src)
        yield _pw(f"squeezenet1_1.fire{i}.expand1x1", hw, s, e, src)
        yield _c3(f"squeezenet1_1.fire{i}.expand3x3", hw, hw, s, e, 1, src)
    yield _pw("squeezenet1_1.conv10", 14, 512, 1000, src)


def resnet18(res: int) -> Iterator[Layer]:
    """He et al. 2016, Table 1 (18 layers): basic blocks of two 3x3 convs, 1x1 s2 shortcuts."""
    tag, src = f"resnet18_{res}", f"ResNet-18 at {res} (He et al. 2016, Table 1)"
    hw, c = res // 4, 64
    for li, out in enumerate((64, 128, 256, 512), 1):
        s = 1 if li == 1 else 2
        yield _c3(f"{tag}.layer{li}.0.conv1", hw, hw, c, out, s, src)
        if s == 2:
            yield _pw(f"{tag}.layer{li}.0.downsample", _out(hw, 2), c, out, src)
        hw = _out(hw, s)
        yield _c3(f"{tag}.layer{li}.conv2", hw, hw, out, out, 1, src)
        c = out
    yield ("gemm", f"{tag}.fc", {"M": 1, "N": 1000, "K": 512}, src)


def densenet121() -> Iterator[Layer]:
    """Huang et al. 2017, Table 1 (224, k=32): dense layers (1x1 to 4k, 3x3 to k) in blocks 2-4, transitions."""
    src = "DenseNet-121 at 224 (Huang et al. 2017, Table 1)"
    for blk, (hw, c0, n) in enumerate([(28, 128, 12), (14, 256, 24), (7, 512, 16)], 2):
        for i in range(0, n, 4):  # every 4th dense layer: the input width grows by 32 per layer
            yield _pw(f"densenet121.block{blk}.layer{i + 1}.conv1", hw, c0 + 32 * i, 128, src)
        yield _c3(f"densenet121.block{blk}.conv2", hw, hw, 128, 32, 1, src)
        if blk < 4:
            yield _pw(f"densenet121.transition{blk}", hw, c0 + 32 * n, (c0 + 32 * n) // 2, src)


def ghostnet() -> Iterator[Layer]:
    """Han et al. 2020, Table 1 (224): ghost modules make half their outputs with a 1x1, half with a cheap 3x3
    depthwise; 3x3 depthwise between the modules of stride-2 bottlenecks."""
    src = "GhostNet 1.0 at 224 (Han et al. 2020, Table 1)"
    yield _c3("ghostnet.stem", 224, 224, 3, 16, 2, src)
    c, hw = 16, 112
    for i, (k, exp, out, s) in enumerate([(3, 16, 16, 1), (3, 48, 24, 2), (3, 72, 24, 1), (5, 72, 40, 2),
                                          (5, 120, 40, 1), (3, 240, 80, 2), (3, 200, 80, 1), (3, 184, 80, 1),
                                          (3, 480, 112, 1), (3, 672, 112, 1), (5, 672, 160, 2), (5, 960, 160, 1)], 1):
        yield _pw(f"ghostnet.b{i}.ghost1.primary", hw, c, exp // 2, src)
        yield _dw(f"ghostnet.b{i}.ghost1.cheap", hw, exp // 2, 1, src)
        if s == 2 and k == 3:
            yield _dw(f"ghostnet.b{i}.dw", hw, exp, 2, src)
        hw = _out(hw, s)
        yield _pw(f"ghostnet.b{i}.ghost2.primary", hw, exp, out // 2, src)
        yield _dw(f"ghostnet.b{i}.ghost2.cheap", hw, out // 2, 1, src)
        c = out


def mnasnet_b1() -> Iterator[Layer]:
    """Tan et al. 2019 (MnasNet-B1, no SE, 224): MBConv stages; 3x3 depthwise only where the kernel is 3."""
    src = "MnasNet-B1 1.0 at 224 (Tan et al. 2019, torchvision mnasnet1_0)"
    yield _c3("mnasnet_b1.stem", 224, 224, 3, 32, 2, src)
    yield _dw("mnasnet_b1.sep.dw", 112, 32, 1, src)
    yield _pw("mnasnet_b1.sep.pw", 112, 32, 16, src)
    c, hw, b = 16, 112, 0
    for t, out, n, s, k in [(3, 24, 3, 2, 3), (3, 40, 3, 2, 5), (6, 80, 3, 2, 5), (6, 96, 2, 1, 3), (6, 192, 4, 2, 5),
                            (6, 320, 1, 1, 3)]:
        for i in range(n):
            b += 1
            st = s if i == 0 else 1
            yield _pw(f"mnasnet_b1.b{b}.expand", hw, c, c * t, src)
            if k == 3:
                yield _dw(f"mnasnet_b1.b{b}.dw", hw, c * t, st, src)
            hw = _out(hw, st)
            yield _pw(f"mnasnet_b1.b{b}.project", hw, c * t, out, src)
            c = out


def yolov3_tiny(res: int) -> Iterator[Layer]:
    """Redmon & Farhadi 2018, yolov3-tiny.cfg: 3x3 convs each followed by a 2x2 maxpool, then the two heads."""
    tag, src = f"yolov3tiny_{res}", f"YOLOv3-tiny at {res} (darknet yolov3-tiny.cfg)"
    hw, c = res, 3
    for i, out in enumerate((16, 32, 64, 128, 256, 512), 1):
        yield _c3(f"{tag}.conv{i}", hw, hw, c, out, 1, src)
        hw, c = (hw // 2 if i < 6 else hw), out
    yield _pw(f"{tag}.conv8", hw, 1024, 256, src)
    yield _c3(f"{tag}.conv9", hw, hw, 256, 512, 1, src)
    yield _pw(f"{tag}.head1", hw, 512, 255, src)
    yield _pw(f"{tag}.conv12", hw, 256, 128, src)
    yield _c3(f"{tag}.conv15", hw * 2, hw * 2, 384, 256, 1, src)
    yield _pw(f"{tag}.head2", hw * 2, 256, 255, src)


def face_detector_slim(h: int, w: int) -> Iterator[Layer]:
    """Ultra-Light-Fast-Generic-Face-Detector-1MB, version-slim (Linzaer 2019): a 3x3 s2 stem and a MobileNetV1-style
    depthwise-separable backbone of base width 16 on a 4:3 frame (320x240 or 640x480)."""
    tag, src = f"face_slim_{w}x{h}", f"Ultra-Light-Fast face detector, version-slim, at {w}x{h}"
    c = 16
    yield _c3(f"{tag}.stem", h, w, 3, c, 2, src)
    h, w = _out(h, 2), _out(w, 2)
    plan = [(32, 1), (32, 2), (32, 1), (64, 2), (64, 1), (64, 1), (64, 1), (128, 2), (128, 1), (128, 1), (256, 2),
            (256, 1)]
    for i, (out, s) in enumerate(plan, 1):
        yield ("dwconv_3x3", f"{tag}.b{i}.dw", {"H": h, "W": w, "C": c, "stride": s}, src)
        h, w = _out(h, s), _out(w, s)
        yield ("gemm", f"{tag}.b{i}.pw", {"M": h * w, "N": out, "K": c}, src)
        c = out


def enet_initial() -> Iterator[Layer]:
    """Paszke et al. 2016, ENet: the initial block's 3x3 s2 conv (3 -> 13, concatenated with a max-pool) at the
    CamVid (360x480) and Cityscapes-half (512x1024 is over the cap; 256x512) input sizes."""
    for h, w in ((360, 480), (256, 512)):
        yield _c3(f"enet_{w}x{h}.initial", h, w, 3, 13, 2, f"ENet initial block at {w}x{h} (Paszke et al. 2016)")


# ---- speech ------------------------------------------------------------------------------------------------

def hello_edge() -> Iterator[Layer]:
    """Zhang et al. 2017 (Hello Edge), Table: DNN, GRU, CRNN and DS-CNN-S/L keyword spotting models on 49x10 MFCC
    (40 ms frames, 20 ms stride; the DNN reads 25 frames)."""
    src = "Hello Edge keyword spotting (Zhang et al. 2017)"
    for size, units in (("s", 144), ("m", 256), ("l", 436)):
        yield ("gemm", f"hello_edge_dnn_{size}.fc1", {"M": 1, "N": units, "K": 250}, src)
        yield ("gemm", f"hello_edge_dnn_{size}.fc2", {"M": 1, "N": units, "K": units}, src)
        yield ("gemm", f"hello_edge_dnn_{size}.out", {"M": 1, "N": 12, "K": units}, src)
    for size, units in (("s", 154), ("m", 250), ("l", 400)):
        yield ("gru", f"hello_edge_gru_{size}", {"T": 49, "I": 10, "H": units}, src)
    for size, units in (("s", 60), ("m", 128), ("l", 136)):  # the second GRU layer reads the first (I = H)
        yield ("gru", f"hello_edge_crnn_{size}.gru2", {"T": 20, "I": units, "H": units}, src)
    yield ("dwconv_3x3", "ds_cnn_s.dw", {"H": 25, "W": 5, "C": 64, "stride": 1}, src)
    yield ("gemm", "ds_cnn_l.pw", {"M": 125, "N": 276, "K": 276}, src)
    yield ("gemm", "ds_cnn_l.fc", {"M": 1, "N": 12, "K": 276}, src)


def whisper_tiny() -> Iterator[Layer]:
    """Radford et al. 2022, Whisper tiny (d=384, 6 heads, FFN 1536): encoder projections over a 1 s chunk (50
    tokens after the stride-2 conv)."""
    src = "Whisper tiny encoder on a 1 s chunk (Radford et al. 2022)"
    yield ("gemm", "whisper_tiny.enc.attn_proj", {"M": 50, "N": 384, "K": 384}, src)
    yield ("gemm", "whisper_tiny.enc.fc1", {"M": 50, "N": 1536, "K": 384}, src)
    yield ("gemm", "whisper_tiny.enc.fc2", {"M": 50, "N": 384, "K": 1536}, src)
    yield _c1("whisper_tiny.conv1_1s", 100, 80, 384, 3, src)
    for secs in (1, 2):  # the stride-2 conv on shorter chunks than the bundled 3 s one
        yield _c1(f"whisper_tiny.conv2_{secs}s", 100 * secs, 384, 384, 3, src, 2)


def strided_speech_convs() -> Iterator[Layer]:
    """Stride-2 1-D convs that downsample speech features: Moonshine's third encoder conv (Jeffries et al. 2024;
    tiny d=288, base d=416; 1 s at 16 kHz is 83 steps there), the 1-D front end of Jasper / Wav2Letter+ (64 features
    -> 256, k11, stride 2) and ESPnet's Conv1dSubsampling2 (80 mels -> d, k3, stride 2, then d -> d, k3)."""
    for size, d in (("tiny", 288), ("base", 416)):
        yield _c1(f"moonshine_{size}.conv3", 83, 2 * d, d, 3,
                  f"Moonshine {size} (Jeffries et al. 2024) encoder conv3 {2 * d} -> {d}, k3, stride 2, 1 s", 2)
    for secs in (1, 2):
        yield _c1(f"jasper.prologue_{secs}s", 100 * secs, 64, 256, 11,
                  f"Jasper / Wav2Letter+ (Li et al. 2019) prologue 64 -> 256, k11, stride 2, {secs} s of 10 ms", 2)
    for d in (144, 256):
        src = f"ESPnet Conv1dSubsampling2 to d={d} (80 mels, 1 s of 10 ms frames)"
        yield _c1(f"espnet.conv1d_subsampling2_d{d}.conv1", 100, 80, d, 3, src, 2)
        yield _c1(f"espnet.conv1d_subsampling2_d{d}.conv2", 50, d, d, 3, src)


def conformer_s() -> Iterator[Layer]:
    """Gulati et al. 2020, Conformer S (d=144, FFN 576): 4x subsampling convs, then 25 frames per second."""
    src = "Conformer-S (Gulati et al. 2020) on 1 s of 80-mel frames"
    yield _c3("conformer_s.subsample.conv1", 100, 80, 1, 144, 2, src)
    for t in (25, 50):
        yield ("gemm", f"conformer_s.ffn1_T{t}", {"M": t, "N": 576, "K": 144}, src)
        yield ("gemm", f"conformer_s.ffn2_T{t}", {"M": t, "N": 144, "K": 576}, src)
        yield ("gemm", f"conformer_s.conv.pw1_T{t}", {"M": t, "N": 288, "K": 144}, src)
        yield ("gemm", f"conformer_s.attn_proj_T{t}", {"M": t, "N": 144, "K": 144}, src)


def matchboxnet() -> Iterator[Layer]:
    """Majumdar & Ginsburg 2020, MatchboxNet 3x1x64 (speech commands): the pointwise convs of its separable
    blocks (the depthwise 1-D convs map to no kernel here), over 1 s at 10 ms."""
    src = "MatchboxNet 3x1x64 (Majumdar & Ginsburg 2020)"
    yield ("gemm", "matchboxnet.prologue.pw", {"M": 50, "N": 128, "K": 64}, src)
    yield ("gemm", "matchboxnet.block.pw", {"M": 50, "N": 64, "K": 64}, src)
    yield ("gemm", "matchboxnet.block1.pw", {"M": 50, "N": 64, "K": 128}, src)
    yield ("gemm", "matchboxnet.epilogue.pw", {"M": 50, "N": 128, "K": 64}, src)


def raw_waveform_cnns() -> Iterator[Layer]:
    """Dai et al. 2017 M5 (16 kHz, 1 s: k3 convs after 4x pools) and its 8 kHz, 32-channel variant from the PyTorch
    speech-commands tutorial; SincNet's second conv; an x-vector TDNN's first layer (dilation dropped)."""
    m5 = "M5 raw-waveform CNN (Dai et al. 2017), 1 s at 16 kHz"
    yield _c1("m5.conv2", 1000, 128, 128, 3, m5)
    yield _c1("m5.conv3", 250, 128, 256, 3, m5)
    yield _c1("m5.conv4", 62, 256, 512, 3, m5)
    m5s = "M5 with 32 channels on 1 s at 8 kHz (PyTorch speech-commands tutorial)"
    yield _c1("m5_8k.conv2", 124, 32, 32, 3, m5s)
    yield _c1("m5_8k.conv3", 31, 32, 64, 3, m5s)
    yield _c1("m5_8k.conv4", 7, 64, 64, 3, m5s)
    yield _c1("sincnet.conv2", 1000, 80, 60, 5,
              "SincNet (Ravanelli & Bengio 2018): second conv 80 -> 60, k5, after the sinc layer's 3x pool")
    yield _c1("xvector.frame1", 200, 30, 512, 5,
              "x-vector TDNN (Snyder et al. 2018) frame1: 30 MFCC -> 512, context 5, 2 s")
    yield ("gemm", "xvector.frame4", {"M": 100, "N": 512, "K": 512},
           "x-vector TDNN frame4 (1x1) 512 -> 512 over 1 s")
    yield _c1("lpcnet.frame_conv2", 100, 128, 128, 3,
              "LPCNet (Valin & Skoglund 2019) frame-rate network, second conv 128 -> 128, k3, 1 s")


def tts_convs() -> Iterator[Layer]:
    """1-D convs of text-to-speech models (dilations dropped: the kernel has none)."""
    for name, t, cin, cout, k, src in [
        ("tacotron2.enc.conv", 40, 512, 512, 5, "Tacotron 2 encoder conv 512 -> 512, k5, over 40 characters"),
        ("tacotron2.postnet.conv1", 100, 80, 512, 5, "Tacotron 2 postnet first conv 80 mels -> 512, k5, 100 frames"),
        ("fastspeech2.variance_predictor", 50, 256, 256, 3,
         "FastSpeech 2 (Ren et al. 2021) variance predictor conv 256 -> 256, k3, over 50 phonemes"),
        ("hifigan_v1.conv_pre", 50, 80, 512, 7,
         "HiFi-GAN V1 (Kong et al. 2020) conv_pre 80 mels -> 512, k7, 50 frames"),
        ("hifigan_v1.resblock.k3", 200, 256, 256, 3,
         "HiFi-GAN V1 first-stage resblock conv 256 -> 256, k3, over 200 upsampled steps"),
        ("wav2letter.conv", 100, 250, 250, 7, "Wav2Letter (Collobert et al. 2016) conv 250 -> 250, k7, 1 s at 10 ms"),
    ]:
        yield _c1(name, t, cin, cout, k, src)


def speech_grus() -> Iterator[Layer]:
    """GRUs of small speech models: Mycroft Precise's wake-word GRU and DeepFilterNet2's embedding GRU."""
    yield ("gru", "precise.gru", {"T": 29, "I": 13, "H": 20}, "Mycroft Precise wake word: 20-unit GRU on 13 MFCC")
    yield ("gru", "deepfilternet2.emb_gru", {"T": 100, "I": 256, "H": 256},
           "DeepFilterNet2 (Schroeter et al. 2022) encoder embedding GRU, 256 units, 1 s of 10 ms frames")


def logmel_front_ends() -> Iterator[Layer]:
    """Front ends of common speech/audio pipelines (n_fft is the window rounded up to a power of two)."""
    for name, shape, src in [
        ("speechbrain.fbank_1s", (16000, 512, 160, 80), "SpeechBrain Fbank: 25 ms / 10 ms, 80 mels, 1 s at 16 kHz"),
        ("speechbrain.fbank_2s", (32000, 512, 160, 80), "SpeechBrain Fbank, 2 s"),
        ("micro_speech.frontend", (16000, 512, 320, 40), "TFLite Micro micro_speech: 30 ms / 20 ms, 40 channels"),
        ("tacotron2.mel", (22050, 1024, 256, 80), "Tacotron 2 / HiFi-GAN mel: 22.05 kHz, n_fft 1024, hop 256, 80"),
        ("musicnn.mel", (48000, 512, 256, 96), "musicnn: 16 kHz, n_fft 512, hop 256, 96 mels, 3 s"),
        ("kws_8k.logmel", (8000, 256, 80, 40), "8 kHz keyword spotting: 32 ms / 10 ms, 40 mels, 1 s"),
        ("esc_44k.logmel", (44100, 1024, 512, 128), "environmental sound at 44.1 kHz: n_fft 1024, hop 512, 128"),
        ("wakeword_8k.logmel", (8000, 256, 128, 32), "8 kHz wake word: 32 ms / 16 ms, 32 mels, 1 s"),
    ]:
        yield ("logmel", name, dict(zip(("samples", "n_fft", "hop", "mels"), shape)), src)


FAMILIES = (
    lambda: mobilenet_v1(1.0, 224), lambda: mobilenet_v1(0.5, 160), lambda: mobilenet_v1(0.25, 128),
    lambda: mobilenet_v1(0.25, 96), lambda: mobilenet_v2(1.0, 224), lambda: mobilenet_v2(0.35, 96),
    lambda: mobilenet_v2(0.5, 160), lambda: shufflenet_v2("0.5"), lambda: shufflenet_v2("1.0"),
    squeezenet_11, lambda: resnet18(160), lambda: resnet18(128), densenet121, ghostnet, mnasnet_b1,
    lambda: yolov3_tiny(256), lambda: face_detector_slim(240, 320), lambda: face_detector_slim(480, 640),
    enet_initial, hello_edge, whisper_tiny, strided_speech_convs, conformer_s, matchboxnet, raw_waveform_cnns,
    tts_convs, speech_grus,
    logmel_front_ends,
)


def heldout_keys(path: Path = HELDOUT) -> set[tuple[str, tuple[int, ...]]]:
    """(kernel, dims) of every held-out real layer."""
    from kernels.workload_files import collect_workloads

    return {shape_id(lw.spec.name, lw.workload.shape) for lw in collect_workloads([str(path)])}


def shape_id(kernel: str, shape: dict) -> tuple[str, tuple[int, ...]]:
    """A (kernel, shape) as a hashable key in the spec's dim order."""
    return kernel, tuple(all_specs()[kernel].dims_vector(shape))


def arch_layers(max_mflop: float = MAX_MFLOP) -> list[WorkloadEntry]:
    """Every distinct (kernel, shape) of the families, first name kept, within max_mflop and valid for its spec;
    shapes that a held-out family shares (real architectures repeat layers: MobileNetV1's block 2 is MobileNetV3-
    Large's) are left to the held-out set."""
    specs, held = all_specs(), heldout_keys()
    out: dict[tuple, WorkloadEntry] = {}
    for family in FAMILIES:
        for kernel, name, shape, src in family():
            shape = specs[kernel].validate_shape(shape)
            key = shape_id(kernel, shape)
            if specs[kernel].flops(shape) / 1e6 > max_mflop or key in held:
                continue
            out.setdefault(key, WorkloadEntry(kernel, shape, name, 1, src))
    return sorted(out.values(), key=lambda e: (e.kernel, e.name))


def read_arch_layers(path: Path = OUT) -> list[WorkloadEntry]:
    from kernels.workload_files import read_workloads_file

    return read_workloads_file(path)


def spread(entries: list[WorkloadEntry], n: int) -> list[WorkloadEntry]:
    """n of one kernel's layers spread over its shapes: farthest-point sampling in log2 dims (each dim scaled to
    its range), from the layer of median work. Deterministic, and the first n of a larger pick, so a collector
    run with a larger n extends a smaller one's shapes."""
    import math

    if len(entries) <= n:
        return list(entries)
    spec = all_specs()[entries[0].kernel]
    vecs = [[math.log2(v) for v in spec.dims_vector(e.shape)] for e in entries]
    span = [max(1e-9, max(col) - min(col)) for col in zip(*vecs)]
    pts = [[x / s for x, s in zip(v, span)] for v in vecs]
    by_work = sorted(range(len(entries)), key=lambda i: (spec.flops(entries[i].shape), entries[i].name))
    chosen = [by_work[len(by_work) // 2]]
    dist = [math.dist(p, pts[chosen[0]]) for p in pts]
    while len(chosen) < n:
        i = max(range(len(pts)), key=lambda j: (dist[j], -j))
        chosen.append(i)
        dist = [min(d, math.dist(p, pts[i])) for d, p in zip(dist, pts)]
    return [entries[i] for i in chosen]


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kernels.workload_files import write_workloads_file

    ap = argparse.ArgumentParser(prog="python -m tuner.train.arch_layers", description=f"write {OUT.relative_to(ROOT)}"
                                 ", the training shapes from real architectures")
    ap.add_argument("--print", action="store_true", help="print the workloads file instead of writing it")
    args = ap.parse_args(argv)
    entries = arch_layers()
    if args.print:
        sys.stdout.write(dumps(entries))
        return 0
    write_workloads_file(OUT, entries, "Training shapes from real architectures (python -m tuner.train.arch_layers; "
                                       f"layers over {MAX_MFLOP:.0f} MFLOP left out).")
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.kernel] = counts.get(e.kernel, 0) + 1
    print(f"{OUT}: {len(entries)} layers ({', '.join(f'{k} {n}' for k, n in sorted(counts.items()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
