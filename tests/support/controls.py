"""The task page's controls as a test sees them: the `[data-action]` elements the server
rendered (from orchestrator/engine/actions.py), and which of them are visible."""
from html.parser import HTMLParser


class _Controls(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rendered: set[str] = set()
        self.visible: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        name = attrs.get("data-action")
        if name:
            self.rendered.add(name)
            if "hidden" not in attrs:
                self.visible.add(name)


def controls(html: str) -> tuple[set[str], set[str]]:
    """(rendered, visible) control names on a rendered task page."""
    parser = _Controls()
    parser.feed(html)
    return parser.rendered, parser.visible


def visible_controls(html: str) -> set[str]:
    return controls(html)[1]


def allowed(actions: list[dict]) -> set[str]:
    """The allowed names in an `actions` list (API task, live `state` message)."""
    return {a["name"] for a in actions if a["allowed"]}
