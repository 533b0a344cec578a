"""A page as the browser holds it, for tests: parse the server-rendered HTML, apply live
fragments the way static/orchestrator/live.js does, and read regions back normalised."""
import re
from xml.etree import ElementTree

import html5lib

CSRF_INPUT = "csrfmiddlewaretoken"


def _parse_fragment(html: str, container: str) -> list:
    fragment = html5lib.parseFragment(html, container=container, namespaceHTMLElements=False)
    return list(fragment)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


class LivePage:
    """The task page or the task list after a sequence of websocket messages, applied as
    the page's script applies them: `event` fragments once each, in seq order (a seq
    already shown is skipped), `fragments` messages as they come."""

    def __init__(self, html: str, last_seq: int = 0):
        self.root = html5lib.parse(html, namespaceHTMLElements=False)
        self.last_seq = last_seq

    def _parents(self) -> dict:
        return {child: parent for parent in self.root.iter() for child in parent}

    def element(self, element_id: str):
        for node in self.root.iter():
            if node.get("id") == element_id:
                return node
        return None

    def swap(self, fragment: dict) -> None:
        target = self.element(fragment["target"])
        if target is None:
            return  # as the script does: a region this page does not have
        if fragment["swap"] == "afterbegin":
            for child in [c for c in target if "data-placeholder" in c.attrib]:
                target.remove(child)
            for index, node in enumerate(_parse_fragment(fragment["html"], _local(target.tag))):
                target.insert(index, node)
            limit = int(target.get("data-max-rows") or 0)
            while limit and len(target) > limit:
                target.remove(target[-1])
        elif fragment["swap"] == "outerHTML":
            parent = self._parents()[target]
            nodes = _parse_fragment(fragment["html"], _local(parent.tag))
            replacement = next(n for n in nodes if isinstance(n.tag, str))
            replacement.tail = target.tail
            parent[list(parent).index(target)] = replacement
        else:
            raise AssertionError(f"unknown swap {fragment['swap']!r}")

    def apply(self, message: dict) -> None:
        if message["type"] == "event":
            if message["seq"] <= self.last_seq:
                return
            self.last_seq = message["seq"]
            for node in self.root.iter():
                if "data-live-task" in node.attrib:
                    node.set("data-seq", str(self.last_seq))
            for fragment in message.get("fragments", []):
                self.swap(fragment)
        elif message["type"] == "fragments":
            for fragment in message["fragments"]:
                self.swap(fragment)

    def region(self, element_id: str) -> str:
        """The element's HTML with whitespace normalised and CSRF tokens blanked (each
        render masks the token anew); "" if the page has no such element."""
        node = self.element(element_id)
        if node is None:
            return ""
        for field in node.iter():
            if field.get("name") == CSRF_INPUT:
                field.set("value", "…")
        text = ElementTree.tostring(node, encoding="unicode", method="html")
        text = re.sub(r"\s+", " ", text)
        return re.sub(r">\s+<", "><", text).strip()
