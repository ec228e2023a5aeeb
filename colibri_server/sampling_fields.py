"""The sampling fields of a generate request: each one's type, default and bounds, in one table.

The wire's checks (wire/protocol.py), the client's defaults (client/core.py) and the engine's
SamplingParams (model/sampler.py) all read it, so a field's default or range lives in one place.
The OpenAI gateway keeps OpenAI's own defaults and ranges where they differ (temperature 1.0 in
[0, 2]; http/openai.py) and hands the router values inside these.

Owns: the table.  Never: imports anything of the package (the model and the client both read it).
"""

MAX_LOGPROBS = 20       # alternatives per position, as OpenAI and vLLM's default


class Field:
    """One sampling field of a generate: its type, default and bounds (lo < v when lo_open, else
    lo <= v; v <= hi). `text` says the range in an error when the bounds' own words do not."""
    __slots__ = ("type", "default", "lo", "hi", "lo_open", "text")

    def __init__(self, typ, default, lo=None, hi=None, lo_open=False, text=None):
        self.type, self.default, self.lo, self.hi, self.lo_open, self.text = typ, default, lo, hi, lo_open, text

    def problem(self, v):
        """None when v is allowed, else the words that end "field 'name' must ..."."""
        if v is None or self.type is bool:
            return None
        low = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        if low and (self.hi is None or v <= self.hi):
            return None
        if self.text:
            return self.text
        if self.hi is None:
            return f">= {self.lo}"
        if self.type is int:
            return f"in {self.lo}..{self.hi}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


# max_tokens is also held to the server's max_tokens setting (the router's check)
SAMPLING_FIELDS = {
    "max_tokens": Field(int, 16, 1),
    "temperature": Field(float, 0.0, 0, 100),
    "top_k": Field(int, 0, 0),
    "top_p": Field(float, 1.0, 0, 1, lo_open=True),
    "min_p": Field(float, 0.0, 0, 1),
    "repetition_penalty": Field(float, 1.0, 0, 100, lo_open=True),
    "seed": Field(int, None, 0, (1 << 63) - 1, text="in 0..2^63-1"),
    "ignore_eos": Field(bool, False),
    "presence_penalty": Field(float, 0.0, -2, 2),
    "frequency_penalty": Field(float, 0.0, -2, 2),
    "logprobs": Field(int, None, 0, MAX_LOGPROBS),
    "prompt_logprobs": Field(int, None, 0, MAX_LOGPROBS),
}
