"""A ReAct agent whose tools run inside the generation loop, on ONE KV file.

    symphony run userland/react.py "What is 37 * 91?"
    symphony run --grant read:/srv/notes userland/react.py "What is the codename of project Zephyr?"
    symphony run --grant http:127.0.0.1:8000 userland/react.py "What does http://127.0.0.1:8000/motd say?"
    options: --no-cache (compute the few-shot prompt in this run, as if no run came before)

The model writes ``Thought: ...`` / ``Action: tool[input]`` lines; at each
action the LIP runs the tool itself and appends ``Observation: ...`` to the
same KV file, so the prompt, the few-shot examples and every earlier step are
never computed twice (the stats line shows it: tokens fed == final KV length).

Tools: ``calc`` (arithmetic, evaluated over the `ast`, never `eval`),
``search`` (grep the files under the directories granted with ``--grant
read:DIR``), ``http`` (GET through the kernel, hosts granted with ``--grant
http:HOST[:PORT]``).

The few-shot prompt is the same in every run: its KV is found, block by
block, in a prefix cache in the user's private KV directory
(``/home/<user>/react``, symphony.lip.prefixcache, the cache the gateway's
serving program keeps for prompts), forked copy-on-write, and only what
follows it is computed; a run that computes it leaves it there for the next
(runs that arrive while it is being computed wait for it and fork it).

SmolLM2-135M drifts from the ReAct format, so the program keeps it there: the
model writes the free text (thoughts, tool inputs, the answer) greedily, but
the line openings are forced choices: after each thought a token mask lets it
pick only ``Action:`` or ``Answer:``, and after ``Action:`` only one of the
tool names.  A tool input ends at ``]`` or a newline; a bad input becomes an
error observation, not a crash.

Sends the transcript line by line, then one JSON line: the answer, the
actions with their observations, the KV length after each step, the
tokens fed to pred, the prompt tokens forked from the cache (``reused``:
``tokens_fed + reused`` is the final KV length: nothing was computed twice)
and the tokens the model decoded (``generated``).
"""
import sys

from symphony.lip import InvalidPath, info, kv, send, tokenizer
from symphony.lip.agents import Writer, calc, http_get, run_tool, search_files
from symphony.lip.prefixcache import PrefixCache

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

TOOLS = {"calc": calc, "search": search_files, "http": http_get}


def start(prompt: list, cache: bool):
    """The KV file the run writes in and the prompt tokens it already holds: with
    ``cache``, the longest cached prefix of the prompt (whole blocks), the file
    promising the prompt's blocks to runs that arrive meanwhile."""
    if not cache:
        return kv.create(), 0
    me = info()
    pc = PrefixCache(f"/home/{me['user']}/react", block=int(me.get("page_size") or 16), user=me["user"])
    try:
        return pc.open(prompt, limit=len(prompt) - 1, promise=len(prompt))
    except InvalidPath as e:                                 # no cache: compute it all
        print(f"react: no prefix cache: {e}", file=sys.stderr, flush=True)
        return kv.create(), 0


def main(*args):
    cache = "--no-cache" not in args
    question = " ".join(a for a in args if a != "--no-cache")
    tok = tokenizer()
    prompt = tok.encode(FEW_SHOT + f"Question: {question}\nThought:")
    f, reused = start(prompt, cache)
    with f:
        a = Writer(f, tok)
        a.pending = prompt[reused:]
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
            obs = run_tool(TOOLS, name, arg)
            send(f"Action: {name}[{arg}]\nObservation: {obs}\n")
            a.write(f"\nObservation: {obs}\nThought:")
            actions.append({"tool": name, "input": arg, "observation": obs})
            lengths.append(len(f))
        send({"answer": answer, "actions": actions, "kv_lengths": lengths + [len(f)],
              "tokens_fed": a.fed, "reused": reused, "generated": a.generated})   # fed + reused == len(f)
