"""torch.cpu's Stream and Event, recorded: what a device-agnostic strategy (FSDP2) calls on a CPU,
where they do nothing, becomes Sync events of the step (zerolab.predict.record), so a GPU's
streams can be replayed (zerolab.predict.timeline): which stream each record and wait is on, the
event waited for (numbered in its step, or the previous one), the stream waited for."""
from __future__ import annotations

import torch


def patch_streams(rec) -> None:
    stream_cls, event_cls = torch.cpu.Stream, torch.cpu.Event

    def waited_event(stream, event) -> None:
        entry = rec.event_ids.get(id(event))
        if entry is not None and rec.step is not None and entry[1] in (rec.step, rec.previous):
            rec.sync("wait_event", stream, entry[2], entry[1] is not rec.step)

    def stream_id(s) -> int:
        if s is None or s is torch.cpu._default_cpu_stream:
            return 0
        return rec.stream_ids.setdefault(id(s), len(rec.stream_ids) + 1)

    def event_record(original):
        def record(event, stream=None):
            # each record is a new point in time, numbered in its step; the object is kept (its id is not reused)
            if rec.step is not None:
                rec.step.events_recorded += 1
                rec.event_ids[id(event)] = (event, rec.step, rec.step.events_recorded)
                rec.sync("record", stream_id(stream) if stream is not None else rec._stream(), rec.step.events_recorded)
            return original(event, stream)
        return record

    def record_event(original):
        def make_event(stream):
            event = event_cls()
            event.record(stream)
            return event
        return make_event

    def wait_event(original):
        def wait(stream, event):
            waited_event(stream_id(stream), event)
            return original(stream, event)
        return wait

    def event_wait(original):
        def wait(event, stream=None):
            waited_event(stream_id(stream) if stream is not None else rec._stream(), event)
            return original(event, stream)
        return wait

    def wait_stream(original):
        def wait(stream, other):
            rec.sync("wait_stream", stream_id(stream), stream_id(other))
            return original(stream, other)
        return wait

    rec._patch(event_cls, "record", event_record)
    rec._patch(event_cls, "wait", event_wait)
    rec._patch(stream_cls, "record_event", record_event)
    rec._patch(stream_cls, "wait_event", wait_event)
    rec._patch(stream_cls, "wait_stream", wait_stream)
