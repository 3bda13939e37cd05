"""Stream chunks of an n > 1 request: each choice's finish is sent once, in its last chunk, as
OpenAI and vLLM send it, though the engine's later outputs still list a finished choice (its
finish_reason, no delta); with tools, a choice's held-back answer goes out once too."""

from __future__ import annotations

from fastgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fastgen.serve.responses import ResponseShape
from fastgen.serve.tool_calls import plan_tools

TOOLS = [{"type": "function", "function": {"name": "count_to", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]


def outputs() -> list[RequestOutput]:
    """Choice 0 ends in the first output; choice 1 goes on for two more, as ParentRequest.merge
    reports them (choice 0 listed again with its finish_reason and empty deltas)."""
    steps = [(("ab", "stop"), ("x", None)), (("", "stop"), ("y", None)), (("", "stop"), ("z", "length"))]
    texts = ["", ""]
    made = []
    for step in steps:
        choices = []
        for i, (new, reason) in enumerate(step):
            texts[i] += new
            choices.append(CompletionOutput(index=i, text=texts[i], token_ids=[1] * len(texts[i]),
                                            finish_reason=reason, new_text=new, new_token_ids=[1] * len(new)))
        finished = all(c.finish_reason for c in choices)
        output = RequestOutput("r", None, [5], choices[0].text, choices[0].token_ids, choices[0].new_text,
                               choices[0].new_token_ids, finished, choices[0].finish_reason, RequestMetrics(0.0))
        output.outputs = choices
        made.append(output)
    return made


def sent(shape: ResponseShape) -> list[dict]:
    return [choice for output in outputs() if (chunk := shape.chunk(output)) for choice in chunk["choices"]]


def test_each_choice_finishes_once_in_completion_and_chat_streams():
    for shape in (ResponseShape("text_completion", "m"), ResponseShape("chat.completion", "m")):
        choices = sent(shape)
        finishes = [(c["index"], c["finish_reason"]) for c in choices if c["finish_reason"] is not None]
        assert finishes == [(0, "stop"), (1, "length")]
        text = {i: "".join(c.get("text", c.get("delta", {}).get("content", "")) for c in choices if c["index"] == i)
                for i in (0, 1)}
        assert text == {0: "ab", 1: "xyz"}


def test_a_tool_answer_held_back_to_its_end_is_sent_once():
    shape = ResponseShape("chat.completion", "m", tools=plan_tools(TOOLS, "auto", None))
    choices = sent(shape)
    assert [(c["index"], c["delta"].get("content"), c["finish_reason"]) for c in choices] == \
        [(0, "ab", "stop"), (1, "xyz", "length")]
