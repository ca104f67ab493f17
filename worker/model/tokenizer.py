"""The extended Alpamayo tokenizer (docs/alpamayo2-model.md section 1.4).

The tokenizer files are read as transformers reads them (`PreTrainedTokenizerFast.from_pretrained`
on the directory, offline: tokenizer.json with tokenizer_config.json's added tokens); the runtime
uses its `tokenizers` backend. The release loads the base Qwen3-VL tokenizer and appends
`<i0>`..`<i999>` (history bins), `<i1000>`..`<i3999>` (future bins) and 29 special tokens, in that order. A checkpoint whose
tokenizer.json already holds them is used as is; otherwise they are appended in the same order,
so the ids come out as the release's. Resolved ids are checked against config `traj_ids`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from worker.model.config import (FUTURE_BINS, HISTORY_BINS, SPECIAL_TOKENS, AlpamayoConfig,
                                 CheckpointError, TokenIds)

log = logging.getLogger("alpamayo.model")
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
NEUTRAL_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}

QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
               "<|image_pad|>")
TRAJ_ID_KEYS = {  # config traj_ids key -> token
    "history_id0": "<i0>", "future_id0": f"<i{HISTORY_BINS}>",
    "history_start": "<|traj_history_start|>", "history_end": "<|traj_history_end|>",
    "history_pad": "<|traj_history|>", "future_start": "<|traj_future_start|>",
    "future_end": "<|traj_future_end|>", "future_pad": "<|traj_future|>",
}


def extend_tokenizer(tok) -> None:
    """Append the trajectory-bin and special tokens that are missing, in the release's order."""
    from tokenizers import AddedToken

    bins = [f"<i{i}>" for i in range(HISTORY_BINS + FUTURE_BINS)]
    missing_bins = [b for b in bins if tok.token_to_id(b) is None]
    if missing_bins:
        tok.add_tokens(missing_bins)
    specials = [s for s in SPECIAL_TOKENS if tok.token_to_id(s) is None]
    if specials:
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])


def load_tokenizer(path: str | Path, cfg: AlpamayoConfig):
    """-> (tokenizers.Tokenizer, TokenIds). Raises CheckpointError naming the mismatch."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True).backend_tokenizer
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: tokenizer files not readable by transformers "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    extend_tokenizer(tok)
    missing = [t for t in QWEN_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise CheckpointError(f"checkpoint {path}: tokenizer.json lacks {', '.join(missing)}")
    for key, token in TRAJ_ID_KEYS.items():
        want = cfg.traj_ids.get(key)
        got = tok.token_to_id(token)
        if want is not None and int(want) != got:
            raise CheckpointError(
                f"checkpoint {path}: config.json traj_ids.{key}={want} but the tokenizer gives {token} id {got}")
    h0 = tok.token_to_id("<i0>")
    if tok.token_to_id(f"<i{HISTORY_BINS + FUTURE_BINS - 1}>") != h0 + HISTORY_BINS + FUTURE_BINS - 1:
        raise CheckpointError(f"checkpoint {path}: trajectory-bin tokens <i0>..<i3999> are not contiguous")
    vocab = int(cfg.text["vocab_size"])
    if tok.get_vocab_size() > vocab:
        raise CheckpointError(f"checkpoint {path}: tokenizer has {tok.get_vocab_size()} tokens but "
                              f"vlm_config.text_config.vocab_size is {vocab}")
    t = tok.token_to_id
    ids = TokenIds(
        history_id0=h0, future_id0=t(f"<i{HISTORY_BINS}>"),
        traj_history_start=t("<|traj_history_start|>"), traj_history_end=t("<|traj_history_end|>"),
        traj_history=t("<|traj_history|>"), traj_future_start=t("<|traj_future_start|>"),
        traj_future_end=t("<|traj_future_end|>"), traj_future=t("<|traj_future|>"),
        im_start=t("<|im_start|>"), im_end=t("<|im_end|>"), endoftext=t("<|endoftext|>"),
        vision_start=t("<|vision_start|>"), vision_end=t("<|vision_end|>"), image_pad=t("<|image_pad|>"),
        pad=t("<|endoftext|>"),
    )
    image_token = cfg.vlm_config.get("image_token_id", 151655)
    if image_token != ids.image_pad:
        raise CheckpointError(f"checkpoint {path}: vlm_config.image_token_id={image_token} but the "
                              f"tokenizer gives <|image_pad|> id {ids.image_pad}")
    return tok, ids


def generation_stop_ids(path: str | Path, vocab_size: int) -> tuple[int, ...]:
    """The stop ids of the checkpoint's generation_config.json (`eos_token_id`, one id or a list),
    which end text-task generation besides the built-in ones; () without the file. Penalties
    this worker does not apply are logged. Raises CheckpointError on an unreadable file or ids
    outside the vocabulary."""
    f = Path(path) / GENERATION_CONFIG
    if not f.is_file():
        return ()
    label = f"checkpoint {path}: {GENERATION_CONFIG}"
    try:
        conf = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{label} is not valid JSON") from None
    raw = conf.get("eos_token_id") if isinstance(conf, dict) else None
    ids = [raw] if isinstance(raw, int) else list(raw) if isinstance(raw, list) else []
    if raw is not None and not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise CheckpointError(f"{label} eos_token_id={raw!r} is not a token id (or list of ids) below {vocab_size}")
    for name, neutral in NEUTRAL_PENALTIES.items():
        if isinstance(conf, dict) and conf.get(name, neutral) != neutral:
            log.warning("%s sets %s=%s, which this worker does not apply (outputs follow the logits)",
                        label, name, conf[name])
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True)
class ChatTemplate:
    """The checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it
    (its jinja2 environment; the tokenizer's special tokens as variables)."""

    source: str
    variables: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.source,
                                            add_generation_prompt=add_generation_prompt, **self.variables)
        return rendered[0]


def load_chat_template(path: str | Path) -> ChatTemplate | None:
    """The chat template transformers would use for the directory: chat_template.jinja, else
    tokenizer_config.json's `chat_template` (a string, or the "default" of a list of named
    templates); None when the checkpoint has none (the built-in rendering is used then)."""
    path = Path(path)
    try:
        conf = json.loads((path / TOKENIZER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        conf = {}
    conf = conf if isinstance(conf, dict) else {}
    source = conf.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if (path / CHAT_TEMPLATE_FILE).is_file():
        source = (path / CHAT_TEMPLATE_FILE).read_text()
    if not isinstance(source, str) or not source:
        return None
    variables = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in conf.items()
                 if k.endswith("_token") and isinstance(v, (str, dict))}
    return ChatTemplate(source, {k: v for k, v in variables.items() if isinstance(v, str)})
