"""Tokenizers: text <-> token ids, and the prompt encoding the engine is fed.

Owns: the built-in byte tokenizer, a wrapper around a Hugging Face `tokenizer.json`
(via the `tokenizers` library) with its special ids read from the files that sit
beside it, the prompt template and chat wrapping (the model's own jinja chat template from
`tokenizer_config.json` when it has one, else built-in ChatML / Llama-3 wrapping), and BOS
handling, and keeping data out of the markup: a prompt's text and an observation are
encoded with special-token matching off, so text that spells `<|im_end|>` never becomes that
token (only the template's own markers are special). Does not own: rendering a jinja template within bounds (`chat_template`),
which prompts exist (`data`), padding prompts into batches (`engine`), or stopping
generation (the engine reads `eos_id` / `stop_ids` from here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from async_rl.config import ConfigError, TokenizerConfig

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: Optional[int]
    eos_id: int
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_prompt(self, prompt: str) -> np.ndarray: ...


# What a padding or BOS token inside a completion reads as to a reward.
UNREADABLE = "\ufffd"


def completion_text(tok, tokens: Sequence[int]) -> str:
    """The text a reward scores: the completion before its stop token, with every padding or
    BOS token in it read as U+FFFD. Decoding drops those ids, so left invisible they would let
    a policy fill the rest of its token budget with them instead of stopping, and be scored
    as if it had stopped."""
    stops = set(getattr(tok, "stop_ids", (tok.eos_id,)))
    specials = {getattr(tok, "pad_id", None), getattr(tok, "bos_id", None)} - stops - {None}
    parts: list[str] = []
    run: list[int] = []
    for t in (int(t) for t in tokens):
        if t in stops:
            break
        if t in specials:
            parts += [tok.decode(run), UNREADABLE]
            run = []
        else:
            run.append(t)
    return "".join(parts) + tok.decode(run)


# Marks data (a prompt's text, an observation) inside rendered markup: what lies between is
# encoded with special-token matching off. Random per process, so no text can spell one.
_OPEN, _CLOSE = f"\x00{uuid.uuid4().hex}[", f"]{uuid.uuid4().hex}\x00"


def _data(text: str) -> str:
    return _OPEN + text + _CLOSE


def _segments(marked: str, where) -> list[tuple[str, bool]]:
    """`marked` cut into (text, is_data) pieces, in order."""
    out = []
    for i, piece in enumerate(marked.split(_OPEN)):
        data, sep, rest = piece.partition(_CLOSE) if i else ("", True, piece)
        if not sep or _CLOSE in rest:
            raise ConfigError(f"{where}: the chat template changes message text (a filter on the content?), so "
                              "the text cannot be kept apart from the template's special tokens")
        out += [(data, True), (rest, False)] if i else [(rest, False)]
    return out


def _render(template: str, prompt: str) -> str:
    # str.format would choke on braces inside the template or the prompt (JSON, LaTeX).
    return template.replace("{prompt}", prompt)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then PAD, BOS, EOS."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259
    stop_ids = (258,)

    def __init__(self, template: str = "{prompt}"):
        self.template = template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Specials and ids past the byte range (padded embedding rows) carry no text.
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def encode_prompt(self, prompt: str) -> np.ndarray:
        ids = [self.bos_id] + self.encode(_render(self.template, prompt))
        return np.asarray(ids, dtype=np.int32)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class CharTokenizer:
    """PAD, BOS, EOS, then one id per character of a small alphabet (the synthetic tasks').

    A 16-token vocabulary gives a random policy a real chance of emitting the right
    characters, so GRPO has a reward signal from the first step."""

    pad_id, bos_id, eos_id = 0, 1, 2
    stop_ids = (2,)
    ALPHABET = "0123456789+-=*/ "

    def __init__(self, template: str = "{prompt}", alphabet: str = ALPHABET):
        self.template, self.alphabet = template, alphabet
        self._ids = {c: i + 3 for i, c in enumerate(alphabet)}
        self.vocab_size = 3 + len(alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the char tokenizer's alphabet "
                             f"{self.alphabet!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        n = len(self.alphabet)
        return "".join(self.alphabet[int(i) - 3] for i in ids if 3 <= int(i) < 3 + n)

    def encode_prompt(self, prompt: str) -> np.ndarray:
        return np.asarray([self.bos_id] + self.encode(_render(self.template, prompt)), dtype=np.int32)

    def __repr__(self) -> str:
        return f"CharTokenizer({self.alphabet!r})"


# Files read for special tokens, in precedence order (the first that names one wins).
_SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

_CHATML = ("<|im_start|>", "<|im_end|>")
_LLAMA3 = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def _token_text(value: Any) -> Optional[str]:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from `DIR/tokenizer.json`."""

    def __init__(self, path: str, template: str = "{prompt}", chat: bool = False, reply_prefix: str = "",
                 system: str = "", first_reply_prefix: str = ""):
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(path).expanduser()
        self.template, self.reply_prefix, self.system = template, reply_prefix, system
        self.tools: Optional[list[dict]] = None  # the env's tools, for `{tools}` in the system message
        # the first reply's opening: a job can force a tool call (a `tool_choice` of "required")
        # and let later turns, which read the tool's result, start free
        self.first_reply_prefix = first_reply_prefix or reply_prefix
        tj = self.path / "tokenizer.json"
        if not tj.is_file():
            raise ConfigError(f"tokenizer.path={path!r}: no tokenizer.json in that directory")
        try:
            self._tok = _HFTok.from_file(str(tj))
            # data's encoder: special-token strings in the text stay text (a copy: the flag is per object)
            self._plain = _HFTok.from_file(str(tj))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ConfigError(f"tokenizer.path={str(path)!r}: cannot load {tj}: {' '.join(str(e).split())}") from None
        self._plain.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        files = {name: self._read_json(name) for name in _SPECIAL_FILES}

        eos = self._special(files, "eos")
        if eos is None:
            raise ConfigError(
                f"tokenizer.path={path!r}: cannot determine the EOS token: none of "
                f"{', '.join(_SPECIAL_FILES)} in {self.path} defines eos_token / eos_token_id")
        self.eos_id: int = eos
        self.bos_id: Optional[int] = self._special(files, "bos")
        pad = self._special(files, "pad")
        # Many causal LMs ship without a pad token; padded positions are masked anyway.
        self.pad_id: int = eos if pad is None else pad
        add_bos = files["tokenizer_config.json"].get("add_bos_token")
        self._add_bos = self.bos_id is not None and add_bos is not False

        stops = [self.eos_id]
        gen_eos = files["generation_config.json"].get("eos_token_id")
        stops += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        self._chat_prefix = self._chat_suffix = ""
        self._chat_template = None
        if chat:
            self._setup_chat(stops)
            self._chat_template = self._load_chat_template(files["tokenizer_config.json"])
        self.stop_ids = tuple(dict.fromkeys(int(s) for s in stops))

    def _read_json(self, name: str) -> dict:
        p = self.path / name
        if not p.is_file():
            return {}
        try:
            doc = json.loads(p.read_bytes())
        except (OSError, ValueError) as e:  # not JSON, or not UTF-8
            raise ConfigError(f"tokenizer.path={str(self.path)!r}: {p} is not valid JSON ({e})") from None
        return doc if isinstance(doc, dict) else {}

    def _special(self, files: dict[str, dict], kind: str) -> Optional[int]:
        for name in _SPECIAL_FILES:
            doc = files[name]
            if name == "generation_config.json":
                val = doc.get(f"{kind}_token_id")
                if isinstance(val, list):
                    val = val[0] if val else None
                if isinstance(val, int) and not isinstance(val, bool):
                    if not 0 <= val < self.vocab_size:
                        raise ConfigError(f"{self.path / name}: {kind}_token_id={val} is outside the "
                                          f"vocabulary (size {self.vocab_size})")
                    return val
                continue
            text = _token_text(doc.get(f"{kind}_token"))
            if text is None:
                continue
            tid = self._tok.token_to_id(text)
            if tid is None:
                raise ConfigError(f"{self.path / name}: {kind}_token {text!r} is not in tokenizer.json")
            return tid
        return None

    def _has(self, tokens: Sequence[str]) -> bool:
        return all(self._tok.token_to_id(t) is not None for t in tokens)

    def _setup_chat(self, stops: list) -> None:
        if self._has(_CHATML):
            self._chat_prefix = "<|im_start|>user\n"
            self._chat_suffix = "<|im_end|>\n<|im_start|>assistant\n"
            stops.append(self._tok.token_to_id("<|im_end|>"))
        elif self._has(_LLAMA3):
            self._chat_prefix = "<|start_header_id|>user<|end_header_id|>\n\n"
            self._chat_suffix = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            stops.append(self._tok.token_to_id("<|eot_id|>"))
        else:
            raise ConfigError(
                f"tokenizer.chat=true: {self.path}/tokenizer.json has neither the ChatML tokens "
                f"({', '.join(_CHATML)}) nor the Llama-3 header tokens ({', '.join(_LLAMA3)}); "
                "set tokenizer.chat=false and write the format into tokenizer.template")

    def _load_chat_template(self, tc: dict):
        """The model's jinja chat template from tokenizer_config.json, or None (built-in wrapping)."""
        src = tc.get("chat_template")
        if isinstance(src, list):  # [{"name": "default", "template": ...}, ...]
            src = next((t.get("template") for t in src if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(src, str) or not src.strip():
            return None
        try:
            import jinja2  # noqa: F401
        except ImportError:
            log.warning("%s: has a chat template but jinja2 is not installed; using built-in "
                        "wrapping", self.path / "tokenizer_config.json")
            return None
        from async_rl.data.chat_template import ChatTemplate
        specials = {f"{k}_token": _token_text(tc.get(f"{k}_token")) or "" for k in ("bos", "eos", "pad", "unk")}
        return ChatTemplate(src, self.path / "tokenizer_config.json", specials)

    def chat_text(self, prompt: str) -> str:
        """The text a prompt is encoded from: template applied, then the chat format, then
        the reply prefix (so the reply continues it)."""
        return "".join(t for t, _ in _segments(self._marked_prompt(prompt), self.path))

    def use_tools(self, tools: Optional[list[dict]]) -> None:
        """The env's tools (as its server lists them): `{tools}` in tokenizer.system becomes their list."""
        self.tools = tools

    def _system(self) -> str:
        if "{tools}" not in self.system:
            return self.system
        if not self.tools:
            raise ConfigError("tokenizer.system: has {tools}, but rollout.env lists no tools (set rollout.env to an "
                              "env with tools, e.g. mcp, or write the tools into the message)")
        from async_rl.data.tool_calls import describe_tools
        return self.system.replace("{tools}", describe_tools(self.tools))

    def _marked_prompt(self, prompt: str) -> str:
        text = _render(self.template, _data(prompt))
        if self._chat_template is not None and self.system:
            text = self._chat_template.messages([{"role": "system", "content": self._system()},
                                                 {"role": "user", "content": text}], True)
        elif self._chat_template is not None:
            text = self._chat_template(text)
        else:
            text = self._system_turn() + self._chat_prefix + text + self._chat_suffix
        return text + self.first_reply_prefix

    def _system_turn(self) -> str:
        # the built-in wrapping's system turn, written as ChatML / Llama-3 write one
        if not self.system:
            return ""
        if self._chat_prefix.startswith("<|im_start|>"):
            return f"<|im_start|>system\n{self._system()}<|im_end|>\n"
        return f"<|start_header_id|>system<|end_header_id|>\n\n{self._system()}<|eot_id|>"

    def render_observation(self, text: str, role: str = "tool", closed: bool = True) -> list[int]:
        """The tokens that follow an assistant reply in a multi-turn episode: the end of the
        reply's turn as the chat format writes it (the end-of-turn token too when the reply was
        cut before it: `closed=False`), the observation as a `role` message, and the next
        assistant turn's opening. Only with tokenizer.chat; otherwise observations are raw text."""
        if not self._chat_prefix:
            return self.encode(text)
        end = self._tok.id_to_token(self.stop_ids[-1])  # the chat format's end-of-turn token
        if self._chat_template is not None:
            user, reply = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
            base = self._chat_template.messages([user, reply], False)
            full = self._chat_template.messages([user, reply, {"role": role, "content": _data(text)}], True)
            cut = base.rfind(end)
            if not full.startswith(base) or cut < 0:
                raise ValueError(f"{self.path}: the chat template does not render an observation after a reply "
                                 "as a continuation of that reply")
            after = base[cut + len(end):] + full[len(base):]
        elif self._has(_CHATML):
            after = f"\n<|im_start|>{role}\n{_data(text)}<|im_end|>\n<|im_start|>assistant\n"
        else:
            after = f"<|start_header_id|>{role}<|end_header_id|>\n\n{_data(text)}<|eot_id|>" \
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"
        return self._encode_marked(("" if closed else end) + after + self.reply_prefix)

    def encode(self, text: str) -> list[int]:
        """Text as data: a special token's string in it is encoded as text, never as the token."""
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def _encode_marked(self, marked: str) -> list[int]:
        # the markup's special-token strings are matched, as apply_chat_template does; the data's are not
        ids: list[int] = []
        for text, data in _segments(marked, self.path):
            if text:
                ids += (self._plain if data else self._tok).encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=True)

    def encode_prompt(self, prompt: str) -> np.ndarray:
        ids = self._encode_marked(self._marked_prompt(prompt))
        if self._add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return np.asarray(ids, dtype=np.int32)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def vocabulary(tok) -> str:
    """What names a tokenizer's token ids: two models that share it score the same ids as the
    same text (a distillation teacher must share the student's)."""
    if isinstance(tok, HFTokenizer):
        items = sorted(tok._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return "hf:" + hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]
    return f"char:{tok.alphabet}" if isinstance(tok, CharTokenizer) else "byte"


def build_tokenizer(cfg: TokenizerConfig, *, synthetic: bool = False):
    """tokenizer.kind: hf (needs tokenizer.path), byte, char, or auto = hf if a path is set,
    else char for the synthetic tasks and byte for prompt files."""
    kind = cfg.kind
    if kind == "auto":
        kind = "hf" if cfg.path else ("char" if synthetic else "byte")
    if kind == "hf":
        if not cfg.path:
            raise ConfigError("tokenizer.kind=hf: needs tokenizer.path (a directory with tokenizer.json)")
        return HFTokenizer(cfg.path, cfg.template, cfg.chat, cfg.reply_prefix, cfg.system,
                           cfg.first_reply_prefix)
    if cfg.chat:
        raise ConfigError(f"tokenizer.chat=true: the built-in {kind} tokenizer has no chat "
                          "template; set tokenizer.path to a tokenizer that has one")
    template = cfg.template + (cfg.first_reply_prefix or cfg.reply_prefix)
    return CharTokenizer(template) if kind == "char" else ByteTokenizer(template)
