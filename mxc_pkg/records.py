"""Records that leave out fields still at their declared defaults when written.

A field added to a saved record (a spec, a plan, an artifact's manifest) is left out of the JSON
while it holds its default, so records written before the field existed keep their canonical
JSON, and with it their hashes and golden files.
"""

from __future__ import annotations

from pydantic import model_serializer


def omit_at_default(*fields: str):
    """A pydantic wrap serializer for a model class body: `_omit = omit_at_default("a", "b")`."""

    def serialize(self, handler):
        data = handler(self)
        declared = type(self).model_fields
        for name in fields:
            if name in data and getattr(self, name) == declared[name].get_default(call_default_factory=True):
                del data[name]
        return data

    return model_serializer(mode="wrap")(serialize)
