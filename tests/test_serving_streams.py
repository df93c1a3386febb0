"""How a streamed response reads its choices' deltas (`coordinator/serving.py`): a lone choice in
the response's own task, several through one queue, a failure as an APIError that ends the
stream."""

from __future__ import annotations

import asyncio

from pdserve.coordinator.choice_stream import ChoiceDelta
from pdserve.coordinator.openai_protocol import APIError
from pdserve.coordinator.serving import _interleaved


class FakeChoice:
    def __init__(self, index: int, texts: list[str], fail: Exception | None = None) -> None:
        self.index = index
        self.request_id = f"req-{index}"
        self.texts = texts
        self.fail = fail
        self.read_in: set[asyncio.Task | None] = set()

    async def deltas(self):
        for text in self.texts:
            self.read_in.add(asyncio.current_task())
            await asyncio.sleep(0)
            yield ChoiceDelta(self.index, text)
        if self.fail is not None:
            raise self.fail


def read(choices: list[FakeChoice]) -> tuple[list, asyncio.Task]:
    async def main() -> tuple[list, asyncio.Task]:
        return [item async for item in _interleaved(choices)], asyncio.current_task()

    return asyncio.run(main())


def test_a_lone_choice_is_read_in_the_response_task_with_no_task_between():
    # A task and a queue between them cost a task switch per token (issue 36).
    choice = FakeChoice(0, ["a", "b", "c"])
    items, response_task = read([choice])
    assert [d.text for d in items] == ["a", "b", "c"]
    assert choice.read_in == {response_task}


def test_a_lone_choice_that_fails_ends_with_an_error_500():
    items, _ = read([FakeChoice(0, ["a"], fail=RuntimeError("boom"))])
    assert items[0].text == "a"
    assert isinstance(items[1], APIError) and items[1].status == 500
    assert len(items) == 2


def test_several_choices_come_interleaved_and_a_failure_as_its_api_error():
    refused = APIError(400, "no", "invalid_request_error")
    items, _ = read([FakeChoice(0, ["a", "b"]), FakeChoice(1, ["x"], fail=refused)])
    texts = sorted(d.text for d in items if isinstance(d, ChoiceDelta))
    assert texts == ["a", "b", "x"]
    assert [i for i in items if isinstance(i, APIError)] == [refused]
