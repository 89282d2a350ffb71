"""JSON schemas of the kinds structured output serves: flat, nested, an array (tests and benchmarks)."""

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "item": {
                "type": "object",
                "properties": {
                    "colour": {"enum": ["red", "green", "blue"]},
                    "count": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["colour", "count"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "price": {"type": "integer", "minimum": 0, "maximum": 10},  # a number's decimals have no bound
        },
        "required": ["item", "tags", "price"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
}
