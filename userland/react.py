"""A ReAct agent whose tools run inside the generation loop, on ONE KV file.

    symphony run userland/react.py "What is 37 * 91?"
    symphony run --grant read:/srv/notes userland/react.py "What is the codename of project Zephyr?"
    symphony run --grant http:127.0.0.1:8000 userland/react.py "What does http://127.0.0.1:8000/motd say?"

The model writes ``Thought: ...`` / ``Action: tool[input]`` lines; at each
action the LIP runs the tool itself and appends ``Observation: ...`` to the
same KV file, so the prompt, the few-shot examples and every earlier step are
never computed twice (the stats line shows it: tokens fed == final KV length).

Tools: ``calc`` (arithmetic, evaluated over the `ast`, never `eval`),
``search`` (grep the files under the directories granted with ``--grant
read:DIR``), ``http`` (GET through the kernel, hosts granted with ``--grant
http:HOST[:PORT]``).

SmolLM2-135M drifts from the ReAct format, so the program keeps it there: the
model writes the free text (thoughts, tool inputs, the answer) greedily, but
the line openings are forced choices: after each thought a token mask lets it
pick only ``Action:`` or ``Answer:``, and after ``Action:`` only one of the
tool names.  A tool input ends at ``]`` or a newline; a bad input becomes an
error observation, not a crash.

Sends the transcript line by line, then one JSON line: the answer, the
actions with their observations, the KV length after each step and the
tokens fed to pred.
"""
import ast
import operator

from symphony.lip import SyscallError, http, info, kv, list_dir, pred, read_file, send, tokenizer

FEW_SHOT = """You answer questions with tools. Tools:
calc[expression]: computes arithmetic
search[word]: finds lines with the word in the files
http[url]: gets the web page at the url

Question: What is 15 * 4 + 2?
Thought: I need to compute 15 * 4 + 2, so I use calc.
Action: calc[15 * 4 + 2]
Observation: 62
Thought: I have the result.
Answer: 62

Question: Who wrote the report on Mars?
Thought: I need to find Mars in the files, so I use search.
Action: search[Mars]
Observation: report.txt: The report on Mars was written by Ada Lin.
Thought: I have the result.
Answer: The report on Mars was written by Ada Lin.

Question: What does the page http://example.org:8080/news say?
Thought: I need to get the web page, so I use http.
Action: http[http://example.org:8080/news]
Observation: Rain expected tomorrow.
Thought: I have the result.
Answer: The page says: Rain expected tomorrow.

"""
MAX_ACTIONS = 4

# ---------------------------------------------------------------- the tools
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calc(expr):
    """Arithmetic on numbers only: + - * / // % ** and parentheses."""
    def ev(n):
        if isinstance(n, ast.Constant) and type(n.value) in (int, float):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Pow) and abs(b) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(n.op)](a, b)
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.operand))
        raise ValueError("not arithmetic")
    expr = expr.replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "").rstrip("= ")
    v = ev(ast.parse(expr, mode="eval").body)
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def search(term):
    """Lines of the granted files that contain the most words of `term`."""
    words = [w for w in term.lower().replace('"', " ").split() if len(w) > 2] or [term.lower()]
    hits, todo, seen = [], list(info()["grants"].get("read", [])), 0
    while todo and seen < 200:
        path = todo.pop(0)
        for name in list_dir(path):
            full = path.rstrip("/") + "/" + name
            if name.endswith("/"):
                todo.append(full)
                continue
            seen += 1
            for line in read_file(full, max_bytes=1 << 16).splitlines():
                score = sum(w in line.lower() for w in words)
                if score:
                    hits.append((-score, f"{name}: {line.strip()}"))
    return "; ".join(h for _, h in sorted(hits)[:3]) or f"no file mentions {term}"


def fetch(url):
    r = http(url.strip().strip("'\""))
    body = " ".join(r["body"].split())[:300]
    return body if r["status"] == 200 else f"HTTP {r['status']}: {body}"


TOOLS = {"calc": calc, "search": search, "http": fetch}


# ---------------------------------------------------------------- generation helpers
class Agent:
    """One KV file, and the tokens not yet fed to it (`pending`)."""

    def __init__(self, f, tok, prompt):
        self.f, self.tok, self.eos = f, tok, set(tok.eos_ids)
        self.pending, self.fed = tok.encode(prompt), 0

    def _pred(self, **kw):
        t = pred(self.f, self.pending, output="argmax", **kw)
        self.fed, self.pending = self.fed + len(self.pending), []
        return t

    def write(self, text):
        """Append forced text (an observation, a line opening)."""
        self.pending = self.pending + self.tok.encode(text)

    def until(self, stop, limit, close=""):
        """Greedy text up to the first character of `stop` (or EOS or `limit`
        tokens); the file gets that text + `close`, whatever the model wrote after."""
        ids = []
        while len(ids) < limit:
            t = self._pred()
            if t in self.eos:
                break
            ids.append(t)
            self.pending = [t]                               # generated, not yet in the KV
            text = self.tok.decode(ids)
            cut = min((text.index(c) for c in stop if c in text), default=-1)
            if cut >= 0:
                head = self.tok.decode(ids[:-1])             # already in the KV
                kept = text[:cut] + close
                self.pending = self.tok.encode(kept[len(head):]) if kept.startswith(head) else [t]
                return text[:cut]
        self.write(close)
        return self.tok.decode(ids)

    def choose(self, options):
        """The model picks one of `options`, constrained token by token with a mask."""
        seqs = [self.tok.encode(o) for o in options]
        done = []
        while True:
            live = [s for s in seqs if s[:len(done)] == done]
            done.append(self._pred(mask=sorted({s[len(done)] for s in live})))
            self.pending = [done[-1]]
            if done in seqs:
                return options[seqs.index(done)]


def main(question, *_):
    tok = tokenizer()
    with kv.create() as f:
        a = Agent(f, tok, FEW_SHOT + f"Question: {question}\nThought:")
        actions, lengths, answer = [], [], ""
        send(f"Question: {question}\n")
        while True:
            send("Thought:" + a.until("\n", 48, close="\n") + "\n")
            line = "Answer:" if len(actions) >= MAX_ACTIONS else a.choose(["Action:", "Answer:"])
            if line == "Answer:":
                if len(actions) >= MAX_ACTIONS:
                    a.write("Answer:")
                answer = a.until("\n", 96).strip()
                send(f"Answer: {answer}\n")
                break
            name = a.choose([f" {n}[" for n in TOOLS]).strip(" [")
            arg = a.until("]\n", 64, close="]").strip()
            try:
                obs = TOOLS[name](arg)
            except (SyntaxError, ValueError, ArithmeticError, SyscallError) as e:
                obs = f"error: {type(e).__name__}: {e}"
            obs = " ".join(obs.split())[:400]
            send(f"Action: {name}[{arg}]\nObservation: {obs}\n")
            a.write(f"\nObservation: {obs}\nThought:")
            actions.append({"tool": name, "input": arg, "observation": obs})
            lengths.append(len(f))
        send({"answer": answer, "actions": actions, "kv_lengths": lengths + [len(f)],
              "tokens_fed": a.fed})                          # == len(f): nothing was recomputed
