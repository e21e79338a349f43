"""Write the torch model + sentencepiece tokenizer as a llama-architecture GGUF (f16), then quantize it to Q8_0
with llama.cpp's own quantizer (llama_model_quantize)."""

from __future__ import annotations

import ctypes
import json
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import sentencepiece as spm

from edgetune.atomic import write_atomic
from tuner.model.scorer import SPEC_KEY, TREES_KEY
from tuner.train.model import TinyLlama


def write_f16(model: TinyLlama, sp_proto: bytes, path: Path, meta: dict) -> None:
    c = model.c
    sp = spm.SentencePieceProcessor(model_proto=sp_proto)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(meta.get("name", "edgetune-tuner"))
    w.add_context_length(c.ctx)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.layers)
    w.add_feed_forward_length(c.ffn)
    w.add_head_count(c.heads)
    w.add_head_count_kv(c.heads)
    w.add_rope_dimension_count(c.dim // c.heads)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.eps)
    w.add_vocab_size(c.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # tokenizer: sentencepiece BPE as llama.cpp's SPM vocab
    toks, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        toks.append(sp.id_to_piece(i).encode())
        scores.append(sp.get_score(i))
        types.append(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                     else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
                     else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_remove_extra_whitespaces(False)
    w.add_string("edgetune.model_version", str(meta.get("version", "")))
    w.add_string("edgetune.dataset_sha256", str(meta.get("dataset_sha256", "")))
    w.add_string("edgetune.prompt_format", str(meta.get("prompt_format", "")))
    w.add_string("edgetune.spaces", json.dumps(meta.get("spaces", {}), sort_keys=True))
    w.add_string("edgetune.training", json.dumps(meta.get("training", {}), sort_keys=True))
    if meta.get("scorer"):
        add_scorer(meta["scorer"], w)

    def t(name: str, x, f16: bool = True) -> None:
        a = x.detach().cpu().float().numpy()
        w.add_tensor(name, a.astype(np.float16) if f16 and a.ndim == 2 else a.astype(np.float32))

    t("token_embd.weight", model.tok.weight)
    for i, b in enumerate(model.blocks):
        t(f"blk.{i}.attn_norm.weight", b.attn_norm.weight)
        t(f"blk.{i}.attn_q.weight", b.wq.weight)
        t(f"blk.{i}.attn_k.weight", b.wk.weight)
        t(f"blk.{i}.attn_v.weight", b.wv.weight)
        t(f"blk.{i}.attn_output.weight", b.wo.weight)
        t(f"blk.{i}.ffn_norm.weight", b.ffn_norm.weight)
        t(f"blk.{i}.ffn_gate.weight", b.w_gate.weight)
        t(f"blk.{i}.ffn_up.weight", b.w_up.weight)
        t(f"blk.{i}.ffn_down.weight", b.w_down.weight)
    t("output_norm.weight", model.norm.weight)
    # tied in torch, but stored twice: llama.cpp's duplicated-tensor path for a missing output.weight crashes on
    # Q8_0 with the CPU repack buffers, and the copy costs only vocab*dim bytes
    t("output.weight", model.tok.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize_q8_0(src: Path, dst: Path, threads: int = 2) -> None:
    import llama_cpp.llama_cpp as L

    from tuner.model.inference import silence_llama

    silence_llama()
    p = L.llama_model_quantize_default_params()
    p.ftype = L.LLAMA_FTYPE_MOSTLY_Q8_0
    p.nthread = threads
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}) failed with {rc}")


def add_scorer(meta: dict[str, Any], w: gguf.GGUFWriter) -> None:
    """Add the scorer metadata (tuner.train.scorer.fit) to a GGUF being written."""
    w.add_string(SPEC_KEY, meta[SPEC_KEY])
    w.add_key_value(TREES_KEY, list(meta[TREES_KEY]), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)


def rewrite_with_scorer(path: Path, meta: dict[str, Any]) -> None:
    """Rewrite a GGUF with this scorer (replacing any it had); tensors and other metadata are copied unchanged."""
    reader = gguf.GGUFReader(path, "r")
    with tempfile.TemporaryDirectory(dir=path.parent) as td:
        out = Path(td) / path.name
        w = gguf.GGUFWriter(out, arch=str(reader.get_field("general.architecture").contents()),
                            endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name in ("general.architecture", SPEC_KEY, TREES_KEY) or field.name.startswith("GGUF."):
                continue
            vtype = field.types[0]
            w.add_key_value(field.name, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
        add_scorer(meta, w)
        for t in reader.tensors:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in reader.tensors:
            w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        w.close()
        del reader
        write_atomic(path, out.read_bytes(), mode=path.stat().st_mode & 0o777)
