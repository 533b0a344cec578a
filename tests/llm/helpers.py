"""What the model tests share: the contract tools offered to the stand-in, and the requests it saw."""
from orchestrator.llm import function_tool


def requests_for(server, model: str) -> list:
    return [r for r in server.requests if r.model == model]


def contract_tools() -> list[dict]:
    return [
        function_tool("contracts.list", "List the contracts", {
            "type": "object", "properties": {"limit": {"type": "integer"}}}),
        function_tool("contracts.read", "Read one contract's text", {
            "type": "object", "properties": {"contract_id": {"type": "string"}}, "required": ["contract_id"]}),
        function_tool("email.send", "Send an email", {
            "type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                             "body": {"type": "string"}},
            "required": ["to", "subject", "body"]}),
    ]
