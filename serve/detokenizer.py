"""Token ids to text as they arrive, without splitting a multi-byte character, and stop strings on that text.

A byte-level BPE (GPT-2's, Llama's) can spread one character over several tokens: decoding the ids so far
and taking what is new can end in "\\ufffd" (half a character). So the text is decoded from a window that starts a
few tokens back (prefix_offset) and only the part after what that window already gave (read_offset) is new,
held back while it ends in "\\ufffd" (the method of vLLM and transformers' TextStreamer).

And the other way, a conversation to prompt text (render_chat): `LLM.chat` and the server's chat completions.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = self.read_offset = 0
        self.stopped_by: str | None = None  # the stop string that matched

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids: list[int]) -> str:
        """Take the newly generated ids; return the text they complete (possibly ""). After a stop string matched,
        text ends before it and nothing more is added."""
        if self.stopped_by is not None:
            return ""
        before = len(self.text)
        for t in new_ids:
            self.ids.append(t)
            self._advance()
            if self.stop and self._cut(before):
                break
        return self.text[before:]

    def _advance(self, flush: bool = False) -> None:
        """The window's new text joins the text unless it ends in half a character (flush: the request has ended)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if flush or (len(window) > len(prefix) and not window.endswith("\ufffd")):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _cut(self, before: int) -> bool:
        """Cut the text before the first stop string that now appears in it (it may span tokens)."""
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)  # a match must end in the new text
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, s = min(hits)
        self.text, self.stopped_by = self.text[:at], s
        return True

    def finish(self) -> None:
        """The request ended: text still held back (a trailing partial character) is flushed as decoded."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            before = len(self.text)
            self._advance(flush=True)
            if self.stop:
                self._cut(before)


PLAIN_TEMPLATE = "{role}: {content}\n"  # per message; then "assistant:" (for a tokenizer without a chat template)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text of a conversation ([{"role": ..., "content": ...}, ...]; content a string or text parts):
    the tokenizer's chat template with the generation prompt when it has one; otherwise each message as
    "role: content" on its own line, then "assistant:". ValueError (one line) for a malformed message."""
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]={m!r}: a message is a dict with a 'role' and a 'content'")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise ValueError(f"messages[{i}]: only text content parts ({{'type': 'text', 'text': ...}}) are "
                                 f"supported")
            content = "".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content must be a string or a list of text parts")
        plain.append({"role": m["role"], "content": content or ""})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    return "".join(PLAIN_TEMPLATE.format(**m) for m in plain) + "assistant:"
