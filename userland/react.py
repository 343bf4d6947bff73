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
actions with their observations, the KV length after each step, the
tokens fed to pred and the tokens the model decoded (``generated``).
"""
from symphony.lip import kv, send, tokenizer
from symphony.lip.agents import Writer, calc, http_get, run_tool, search_files

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


def main(question, *_):
    tok = tokenizer()
    with kv.create() as f:
        a = Writer(f, tok, FEW_SHOT + f"Question: {question}\nThought:")
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
              "tokens_fed": a.fed, "generated": a.generated})                          # == len(f): nothing was recomputed
