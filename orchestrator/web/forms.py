"""The forms generated from a task type's params JSON schema (and the limits): the fields,
reading and checking a posted form, putting errors next to their fields, prefilling."""
import json

from ..engine import services
from ..presenters.task_page import json_text  # noqa: F401 - the pages render JSON as the task page does

LIMIT_FIELDS = [
    ("max_steps", "Max steps", "integer", "Pause after this many steps"),
    ("max_tokens", "Max tokens", "integer", "Pause once this many LLM tokens are used"),
    ("max_seconds", "Max seconds", "number", "Pause after this much active run time"),
    ("max_subtasks", "Max subtasks", "integer", "How many subtasks may run at once (1–64)"),
    ("max_cost", "Max cost", "number", "What its model calls may cost, at the model profiles' prices (empty: no "
                                       "limit); the task pauses when it is reached"),
]
TEXTAREA_MIN_LENGTH = 300  # strings allowed to be longer than this get a textarea


def _resolve(schema: dict, defs: dict) -> dict:
    """Follow a $ref, and reduce `Optional[X]` (anyOf X|null) to X."""
    seen = 0
    while "$ref" in schema and seen < 10:
        ref = schema["$ref"].rsplit("/", 1)[-1]
        schema = {**defs.get(ref, {}), **{k: v for k, v in schema.items() if k != "$ref"}}
        seen += 1
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if options:
            non_null = [o for o in options if o.get("type") != "null"]
            if len(non_null) == 1:
                inner = _resolve(non_null[0], defs)
                merged = {**inner, **{k: v for k, v in schema.items() if k != key}}
                merged["nullable"] = len(non_null) != len(options)
                return merged
    return schema


def _widget(prop: dict) -> str:
    kind = prop.get("type")
    if "enum" in prop:
        return "select"
    if kind in ("integer", "number"):
        return "number"
    if kind == "boolean":
        return "checkbox"
    if kind == "array" and (prop.get("items") or {}).get("type", "string") == "string":
        return "lines"
    if kind == "string":
        if prop.get("format") == "textarea" or prop.get("widget") == "textarea":
            return "textarea"
        max_length = prop.get("maxLength")
        return "textarea" if max_length is not None and max_length > TEXTAREA_MIN_LENGTH else "text"
    return "json"


def _display(widget: str, value):
    """A value as its generated field shows it."""
    if value is None:
        return "" if widget != "checkbox" else False
    if widget == "checkbox":
        return bool(value)
    if widget == "lines":
        return "\n".join(str(v) for v in value)
    if widget == "json":
        return json.dumps(value, indent=2)
    return str(value)


def _initial(widget: str, prop: dict):
    return _display(widget, prop.get("default"))


def prefill(fields: list[dict], values: dict) -> list[dict]:
    """Show `values` (e.g. a task's current params) in the generated fields."""
    for field in fields:
        if field["key"] in values:
            field["value"] = _display(field["widget"], values[field["key"]])
    return fields


def _number_bound(prop: dict, inclusive: str, exclusive: str):
    if prop.get(inclusive) is not None:
        return prop[inclusive]
    if isinstance(prop.get(exclusive), (int, float)) and prop.get("type") == "integer":
        return prop[exclusive] + (1 if exclusive == "exclusiveMinimum" else -1)
    return None


def param_fields(schema: dict, prefix: str = "params") -> list[dict]:
    """Form fields for a pydantic model's JSON schema, named `<prefix>.<key>` (a task type's
    params; a tool's arguments on the approval page)."""
    defs = schema.get("$defs", {})
    required = set(schema.get("required", []))
    fields = []
    for key, raw in (schema.get("properties") or {}).items():
        prop = _resolve(raw, defs)
        widget = _widget(prop)
        field = {
            "name": f"{prefix}.{key}",
            "key": key,
            "label": prop.get("title") or key.replace("_", " ").capitalize(),
            "help": prop.get("description", ""),
            "widget": widget,
            "type": prop.get("type", ""),
            "required": key in required,
            "value": _initial(widget, prop),
            "errors": [],
        }
        if widget == "number":
            field["min"] = _number_bound(prop, "minimum", "exclusiveMinimum")
            field["max"] = _number_bound(prop, "maximum", "exclusiveMaximum")
            field["step"] = "1" if prop.get("type") == "integer" else "any"
        elif widget == "select":
            field["choices"] = [str(c) for c in prop["enum"]]
        elif widget in ("text", "textarea"):
            field["maxlength"] = prop.get("maxLength")
            # Offered, not imposed (e.g. an agent's model: the profiles, or any model's name).
            field["suggestions"] = [str(x) for x in prop.get("examples") or [] if isinstance(x, (str, int, float))]
        fields.append(field)
    return fields


def limit_fields() -> list[dict]:
    defaults = services.harness.default_limits
    schema = services.Limits.model_json_schema()
    fields = []
    for key, label, kind, help_text in LIMIT_FIELDS:
        prop = _resolve(schema["properties"].get(key, {}), {})
        fields.append({
            "name": f"limits.{key}", "key": key, "label": label, "help": help_text, "widget": "number",
            "type": kind, "required": False, "value": "", "errors": [],
            "placeholder": defaults.get(key, ""),
            "min": _number_bound(prop, "minimum", "exclusiveMinimum"),
            "max": _number_bound(prop, "maximum", "exclusiveMaximum"),
            "step": "1" if kind == "integer" else "any",
        })
    return fields


def _coerce_number(raw: str, kind: str):
    """The number the user typed, or the raw text so that validation names the problem."""
    try:
        if kind == "integer":
            return int(raw)
        return float(raw)
    except ValueError:
        return raw


def read_field(field: dict, data) -> tuple[bool, object]:
    """(present, value) of one generated field in POST data; keeps the raw input on the field."""
    widget, name = field["widget"], field["name"]
    if widget == "checkbox":
        field["value"] = name in data
        return True, field["value"]
    raw = data.get(name, "")
    field["value"] = raw
    if widget == "lines":
        items = [line.strip() for line in raw.splitlines() if line.strip()]
        return (bool(items) or field["required"]), items
    if raw.strip() == "":
        return False, None
    if widget == "number":
        return True, _coerce_number(raw.strip(), field["type"])
    if widget == "json":
        try:
            return True, json.loads(raw)
        except ValueError as exc:
            field["errors"].append(f"Not valid JSON: {exc}")
            return False, None
    return True, raw


def attach_errors(errors: list, fields: list[dict]) -> list[str]:
    """Put each field error next to its field; return the ones that match no field."""
    by_name = {f["name"]: f for f in fields}
    general = []
    for error in errors:
        parts = error.field.split(".")
        target = by_name.get(".".join(parts[:2]))
        if target is None:
            general.append(f"{error.field}: {error.message}" if error.field else error.message)
        else:
            detail = f" (item {int(parts[2]) + 1})" if len(parts) > 2 and parts[2].isdigit() else ""
            target["errors"].append(error.message + detail)
    return general


def read_form(type_name: str, fields: list[dict], limits: list[dict], data) -> tuple[dict, dict, list]:
    """(params, limits, errors) from a posted generated form: the params checked against
    the type's schema (defaults filled in), the limits as given (checked, not filled in).
    Params and limits are checked separately so that every error shows at once; errors
    local to a field (bad JSON) are on the field itself."""
    params, limit_values = {}, {}
    for field in fields:
        present, value = read_field(field, data)
        if present:
            params[field["key"]] = value
    for field in limits:
        present, value = read_field(field, data)
        if present:
            limit_values[field["key"]] = value
    errors = []
    try:
        params = services.validate_params(type_name, params)
    except services.InvalidInput as exc:
        errors.extend(exc.errors)
    try:
        services.validate_limits(limit_values)
    except services.InvalidInput as exc:
        errors.extend(exc.errors)
    return params, limit_values, errors


