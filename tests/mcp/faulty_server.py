"""An MCP server of the tests' own (the SDK's MCPServer, formerly FastMCP), for what servers
nobody here wrote do not do on demand: drop the connection after a request arrived, answer
slowly (and note a cancellation), answer with an error, lose a tool between two turns, check a
bearer token (streamable HTTP). Everything it sees goes to a journal (a JSON object a line):
the tools called with their `_meta`, cancellations, and with --wire every line the client wrote.

    python tests/mcp/faulty_server.py JOURNAL [--wire] [--echo-v2]      # stdio (--echo-v2: echo takes `loud` too)
    python tests/mcp/faulty_server.py JOURNAL --http PORT --token TOKEN  # streamable HTTP
    python tests/mcp/faulty_server.py JOURNAL --malformed               # stdio, by hand: bad results
"""
import json
import os
import sys
import threading

JOURNAL = sys.argv[1]
META_KEY = "io.orchestrator/idempotency-key"  # orchestrator/tools/mcp.py IDEMPOTENCY_META_KEY (not imported: a child)


def note(**entry) -> None:
    with open(JOURNAL, "a") as journal:
        journal.write(json.dumps(entry) + "\n")


def read_journal() -> list[dict]:
    try:
        with open(JOURNAL) as journal:
            return [json.loads(line) for line in journal if line.strip()]
    except FileNotFoundError:
        return []


def record_the_wire() -> None:
    """Every line the client writes goes to the journal, then to the server: fd 0 becomes a pipe
    fed by a thread reading the real stdin."""
    real_stdin = os.dup(0)
    read_end, write_end = os.pipe()
    os.dup2(read_end, 0)
    os.close(read_end)

    def pump():
        with os.fdopen(real_stdin, "rb") as source, os.fdopen(write_end, "wb", buffering=0) as sink:
            for line in source:
                try:
                    note(wire=json.loads(line))
                except ValueError:
                    note(wire_unreadable=line.decode(errors="replace"))
                sink.write(line)

    threading.Thread(target=pump, daemon=True).start()


def malformed_server() -> None:
    """JSON-RPC by hand: an old-style handshake, two tools, and results no client can read."""
    tools = [{"name": "broken_read", "description": "reads", "inputSchema": {"type": "object"},
              "annotations": {"readOnlyHint": True}},
             {"name": "broken_write", "description": "writes", "inputSchema": {"type": "object"}}]
    out = sys.stdout
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification
        method, reply = message.get("method"), {"jsonrpc": "2.0", "id": message["id"]}
        if method == "initialize":
            reply["result"] = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                               "serverInfo": {"name": "malformed", "version": "1"}}
        elif method == "tools/list":
            reply["result"] = {"tools": tools}
        elif method == "tools/call":
            note(called=message["params"]["name"], meta=message["params"].get("_meta") or {})
            reply["result"] = {"content": "this is not a list of content blocks", "isError": "perhaps"}
        else:
            reply["error"] = {"code": -32601, "message": f"method not found: {method}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> None:
    import anyio
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import ToolAnnotations

    server = MCPServer("faulty")
    read_only = ToolAnnotations(readOnlyHint=True)

    def called(name: str, ctx: Context, **arguments) -> None:
        note(called=name, arguments=arguments, meta=dict(ctx.request_context.meta or {}))

    if "--echo-v2" in sys.argv:  # a new version of the server: echo's signature changed
        @server.tool(annotations=read_only)
        def echo(text: str, loud: bool, ctx: Context) -> str:
            """Say the text back."""
            called("echo", ctx, text=text, loud=loud)
            return f"echo: {text.upper() if loud else text}"
    else:
        @server.tool(annotations=read_only)
        def echo(text: str, ctx: Context) -> str:
            """Say the text back."""
            called("echo", ctx, text=text)
            return f"echo: {text}"

    @server.tool(annotations=read_only)
    async def slow(seconds: float, ctx: Context) -> str:
        """Wait, then answer."""
        called("slow", ctx, seconds=seconds)
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            note(cancelled="slow")
            raise
        return "done waiting"

    @server.tool()
    async def slow_write(seconds: float, ctx: Context) -> str:
        """Wait, then write (not idempotent)."""
        called("slow_write", ctx, seconds=seconds)
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            note(cancelled="slow_write")
            raise
        return "written"

    @server.tool()
    def record(entry: str, ctx: Context) -> str:
        """Write an entry (not idempotent: twice writes it twice)."""
        called("record", ctx, entry=entry)
        return f"recorded {entry}"

    @server.tool(annotations=ToolAnnotations(idempotentHint=True))
    def put(entry: str, ctx: Context) -> str:
        """Set an entry (idempotent)."""
        called("put", ctx, entry=entry)
        return f"put {entry}"

    @server.tool()
    def crash(entry: str, ctx: Context) -> str:
        """Dies once the request has arrived, answering nothing."""
        called("crash", ctx, entry=entry)
        os._exit(3)

    @server.tool(annotations=ToolAnnotations(idempotentHint=True))
    def flaky_put(entry: str, ctx: Context) -> str:
        """Set an entry (idempotent); the first time an entry arrives the server sets it, then dies
        answering nothing: the replays with the same key find it set."""
        key = dict(ctx.request_context.meta or {}).get(META_KEY)
        first = not any(e.get("called") == "flaky_put" and e["meta"].get(META_KEY) == key for e in read_journal())
        called("flaky_put", ctx, entry=entry)
        if first:
            os._exit(3)
        return f"put {entry} (already set)"

    @server.tool(annotations=read_only)
    def refuse(reason: str, ctx: Context) -> str:
        """Fails (a result with isError)."""
        called("refuse", ctx, reason=reason)
        raise ToolError(f"refused: {reason}")

    @server.tool(annotations=read_only)
    def leak(ctx: Context) -> str:
        """Tells what it was given: its secret environment, the request's Authorization header
        (a server that echoes secrets; printed to its stderr too)."""
        headers = dict(ctx.headers or {})
        told = f"secret={os.environ.get('FAULTY_SECRET', '')} authorization={headers.get('authorization', '')}"
        called("leak", ctx, told=told, environment=sorted(os.environ))  # the names only, for the journal
        print(f"leaking {told}", file=sys.stderr, flush=True)
        return told

    @server.tool()
    def retire(tool: str, ctx: Context) -> str:
        """Remove one of this server's tools."""
        called("retire", ctx, tool=tool)
        server.remove_tool(tool)
        return f"{tool} retired"

    if "--http" in sys.argv:
        import uvicorn
        from starlette.middleware.base import BaseHTTPMiddleware
        from starlette.responses import JSONResponse

        port, token = int(sys.argv[sys.argv.index("--http") + 1]), sys.argv[sys.argv.index("--token") + 1]

        class Bearer(BaseHTTPMiddleware):
            async def dispatch(self, request, call_next):
                if request.headers.get("authorization") != f"Bearer {token}":
                    note(refused=request.url.path)
                    return JSONResponse({"error": "unauthorized"}, status_code=401)
                return await call_next(request)

        app = server.streamable_http_app()
        app.add_middleware(Bearer)
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    else:
        server.run()


if __name__ == "__main__":
    note(started=os.getpid())
    if "--malformed" in sys.argv:
        malformed_server()
    else:
        if "--wire" in sys.argv:
            record_the_wire()
        main()
