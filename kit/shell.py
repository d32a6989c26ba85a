"""bash, far enough to check a job script: a run in the mind (what each variable holds at each command) of what
kit.bash's lexer and parser read (which commands run, in which order, under which conditions), within a work budget.
Owns: the shell reading. Imports: kit.bash, kit.bounded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from kit.bash import HereDoc, Node, ShellLexer, ShellParser, TooComplex, Word  # noqa: F401 (HereDoc: kit.jobscript's)
from kit.bounded import whole_number


# -- what each variable holds at each command: bash run in the mind --

class Arr(list):
    """An array variable: a list of values."""


UNKNOWN = None  # a value this reading cannot know: set by the environment, a command, a loop, a branch not taken

PER_TASK = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID", "SLURM_STEP_ID", "SLURM_STEPID",
            "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE",
            "SLURMD_NODENAME", "SLURM_GTIDS")


# the variables of a command's environment that srun reads and a Ran carries (srun/libsrun/opt.c env_vars)
SRUN_READS = ("SRUN_", "SLURM_EXPORT_ENV")


@dataclass
class Ran:
    """A simple command as bash runs it: its fields after expansion (an expansion this reading cannot know stays as
    written, e.g. '$ARGS' or '${CHUNKS[$SLURM_ARRAY_TASK_ID]}', so it contains '$'), its NAME=value prefixes, and
    the SRUN_/SLURM_ variables exported at that point (srun reads them)."""
    fields: list[str]
    env: dict[str, str | None]
    line: int
    conditional: bool
    exported: dict[str, str | None]


class StopScript(Exception):
    """An `exit` that always runs: nothing after it does."""


class ShellBudget:
    """What reading one script may cost, shared by every shell run in it (the script's, eval's, bash -c's): STEPS
    commands run, expansions, and variables carried through a branch; BYTES of values made by expansions, all
    values together (a piece of a value counts its text and 8 bytes, its slot in the list). A script of a few
    hundred bytes can ask for more than any budget: a function that calls itself ten times, 8 calls deep, is 10^8
    calls; a value doubled on each of 40 lines is 2^40 bytes. Past the budget, TooComplex stops the reading at the
    line being run, and what was read up to there stands. Measured on the worst scripts tried (docs/faults.md): a
    few tenths of a second and under 100 MB.
    A step is a unit of cost, not a count of commands (issue 42: one step multiplied 4,299-digit numbers 490 times,
    or compiled a 1,000-character expression, or lexed a 100 kB array body again): a piece of work that reads text
    costs a step per CHARS characters of it (ARITHMETIC_CHARS for an arithmetic expression, which Python parses and
    compiles), and a lexer run inside the reading (an array's body, eval's and bash -c's text, a default value)
    costs its own lexer steps, stopping where the budget does. One step is about 10 microseconds here."""

    STEPS = 50_000
    BYTES = 32 * 2 ** 20
    CHARS = 1000  # characters matched by a regular expression per step (a few ns each)
    ARITHMETIC_CHARS = 5  # characters of an arithmetic expression parsed and compiled per step (about 1.2 us each)

    def __init__(self) -> None:
        self.steps = self.bytes = 0
        self.line = 0  # the script's line being run (inside a function: the line that called it)

    def spend(self, steps: int = 0, nbytes: int = 0) -> None:
        self.steps += steps
        self.bytes += nbytes
        if self.steps > self.STEPS:
            raise TooComplex(self.line, f"more than {self.STEPS} steps of work to follow (commands, expansions, "
                             "arithmetic, text read again)")
        if self.bytes > self.BYTES:
            raise TooComplex(self.line, f"its variables' values grow past {self.BYTES >> 20} MiB")

    def left(self) -> int:
        """The steps left: a nested lexer's limit."""
        return max(1, self.STEPS - self.steps + 1)

    def value(self, value) -> None:
        """Spend what a value just made holds (pieces, or an Arr of pieces)."""
        items = value if isinstance(value, Arr) else [value]
        self.spend(0, sum(len(t) + 8 for item in items for t, _ in item))


class ShellRun:
    """Walks the parsed script keeping what each variable holds; `sink` gets every simple command that runs. A value
    is a list of (text, known) pieces, so '--chunks $CH' keeps '$CH' whole when CH is unknown."""

    MAX_CALLS = 8  # functions calling functions: the depth; the count is the budget's
    MAX_ARITHMETIC = 1000  # characters of a $(( )) this reading works out; longer ones are left unknown

    def __init__(self, variables: dict, sink, exported: set[str] | None = None,
                 budget: ShellBudget | None = None) -> None:
        self.budget = budget or ShellBudget()
        self.top = budget is None  # the script's own shell (not eval's or bash -c's text): it tells the line
        self.budget.spend(len(variables) // 100)  # bash -c's shell: the exported variables, copied
        self.cut: TooComplex | None = None  # where the budget stopped the reading
        self.vars: dict = dict(variables)
        self.exported = set(variables) if exported is None else set(exported)
        self.functions: dict[str, Node] = {}
        self.positional: list | None = None  # the script's own $1 ... are unknown (sbatch job.slurm ARGS)
        self.sink, self.conditional, self.calls, self.nesting = sink, 0, 0, 0
        self.sourced: list[str] = []
        self.arrays: dict[str, list] = {}  # an array body's tokens, lexed once (a function assigns it at each call)
        self._srun: tuple[int, list[str]] = (-1, [])  # srun_exported's list, and the count of names it was made from

    def lex(self, text: str) -> "ShellLexer":
        """A lexer run inside the reading (eval's and bash -c's text, an array's body), charged to the budget: its
        steps are the budget's, and it stops where the budget does (TooComplex)."""
        lexer = ShellLexer(text, limit=self.budget.left()).run()
        self.budget.spend(lexer.count)
        return lexer

    @staticmethod
    def known(text: str) -> list:
        return [(text, True)]

    @staticmethod
    def joined(value) -> list:
        """An array's elements joined by spaces, as "${a[*]}" gives them; a scalar as it is."""
        if isinstance(value, Arr):
            out = []
            for n, item in enumerate(value):
                out += ([(" ", True)] if n else []) + item
            return out
        return value

    def text_of(self, value) -> str | None:
        if value is UNKNOWN:
            return None
        pieces = self.joined(value)
        self.budget.value(pieces)
        return "".join(t for t, _ in pieces) if all(k for _, k in pieces) else None

    # ---- expansions ----
    def lookup(self, name: str, index: str | None = None):
        if name.isdigit() or name in ("@", "*", "#"):
            if self.positional is None:
                return UNKNOWN
            if name in ("@", "*"):
                return Arr(list(p) for p in self.positional)
            if name == "#":
                return self.known(str(len(self.positional)))
            k = whole_number(name)  # ${99999...}: 5,000 digits are no traceback
            return list(self.positional[k - 1]) if 0 < k <= len(self.positional) else []
        value = self.vars.get(name, UNKNOWN)
        if value is UNKNOWN or index is None:
            return value[0] if isinstance(value, Arr) and value else ([] if isinstance(value, Arr) else value)
        if index in ("@", "*"):
            return value if isinstance(value, Arr) else Arr([value])
        n = self.arith(index)
        items = value if isinstance(value, Arr) else Arr([value])
        return UNKNOWN if n is None else (items[n] if 0 <= n < len(items) else [])

    def arith(self, expr: str) -> int | None:
        """bash's integer $(( )) with the variables this reading knows; None when it cannot tell. bash computes in 64
        bits: an operand of more than 19 digits is left unknown (a variable of 4,299 digits multiplied 490 times took
        78 s), and the expression, its variables put in, costs a step per ARITHMETIC_CHARS characters (compiling
        it is the cost: a 1,000-character one 1.2 ms)."""
        import ast
        self.budget.spend(1 + len(expr) // ShellBudget.ARITHMETIC_CHARS)
        if len(expr) > self.MAX_ARITHMETIC:
            return None

        def value(m: re.Match) -> str:
            text = self.text_of(self.lookup(m.group(1) or m.group(2)))
            if text is None or not re.fullmatch(r"[ \t\n]*-?[0-9]{0,19}[ \t\n]*", text[:64]):
                raise ValueError(m.group(0))
            return f"({text.strip() or '0'})"
        try:
            src = re.sub(r"\$\{?([A-Za-z_]\w*)\}?|\b([A-Za-z_]\w*)\b", value, expr)
            self.budget.spend(len(src) // ShellBudget.ARITHMETIC_CHARS)
            if re.search(r"[0-9]{20}", src):  # a literal past 64 bits: bash's result is not Python's
                return None
            tree = ast.parse(src.replace("/", "//").strip() or "0", mode="eval")
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            return None
        allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv,
                   ast.Mod, ast.USub, ast.UAdd)
        if not all(isinstance(n, allowed) and not (isinstance(n, ast.Constant) and type(n.value) is not int)
                   for n in ast.walk(tree)):
            return None
        try:  # only integer literals and + - * // % are left: nothing here can run code or grow without bound
            result = eval(compile(tree, "<arithmetic>", "eval"), {"__builtins__": {}})
        except (ArithmeticError, RecursionError):
            return None
        return result if abs(result) < 2 ** 63 else None

    def expansion(self, raw: str):
        """The value of one expansion as written ($X, ${X:-d}, ${A[1]}, $((1+2)), ...), or UNKNOWN."""
        self.budget.spend(1 + len(raw) // ShellBudget.CHARS)
        if raw.startswith("$((") and raw.endswith("))"):
            n = self.arith(raw[3:-2])
            return UNKNOWN if n is None else self.known(str(n))
        m = re.fullmatch(r"\$(?:([A-Za-z_]\w*|[0-9@*#])|\{(#?)([A-Za-z_]\w*|[0-9]+|[@*#])(?:\[([^\]]*)\])?"
                         r"(?:(:?[-=+?])(.*))?\})", raw, re.S)
        if raw == "$":
            return self.known("$")
        sliced = re.fullmatch(r"\$\{([@*])(?::([0-9]+))(?::([0-9]+))?\}", raw)  # ${@:2}, ${@:2:3}: positional slices
        if sliced:
            args = self.lookup(sliced.group(1))
            if args is UNKNOWN:
                return UNKNOWN
            first = whole_number(sliced.group(2))
            start = first - 1 if first else 0
            end = start + whole_number(sliced.group(3)) if sliced.group(3) else None
            return Arr(args[max(0, start):end])
        if not m:
            return UNKNOWN  # $(command), `command`, <(...), ${X%pattern} ...
        if m.group(1):
            return self.lookup(m.group(1))
        length, name, index, op, alt = m.groups()[1:]
        value = self.lookup(name, index)
        if length:
            text = self.text_of(value)
            if isinstance(value, Arr):
                return self.known(str(len(value)))
            return UNKNOWN if text is None else self.known(str(len(text)))
        # a variable the script never sets is taken as unset (its default applies: the idiom's intent); one the
        # script sets to something this reading can't know leaves the branch unknown
        unset = name not in self.vars and not (name.isdigit() and self.positional is not None)
        if not op or (value is UNKNOWN and not unset):
            return value
        empty = unset or self.text_of(value) == ""
        if (op in (":-", ":=") and empty) or (op in ("-", "=") and unset):
            word = self.expand_text(alt)
            if op.endswith("=") and word is not UNKNOWN:
                self.vars[name] = word
            return word
        if op in (":+", "+"):
            return [] if (empty if op == ":+" else unset) else self.expand_text(alt)
        return value

    def expand_text(self, text: str):
        """Text expanded as inside double quotes (a default value); unknown where defaults nest past MAX_CALLS."""
        self.budget.spend(1, len(text))
        if self.nesting >= self.MAX_CALLS:
            return UNKNOWN
        lexer = ShellLexer('"' + text.replace('"', '\\"') + '"', limit=self.budget.left())
        word = lexer.word(emit=False)
        self.budget.spend(lexer.count)  # a default of 100,000 pieces is 100,000 steps, at each expansion
        self.nesting += 1
        try:
            return self.scalar(word) if word else []
        finally:
            self.nesting -= 1

    def scalar(self, word: Word) -> list:
        """The value of a word where bash does not split it (an assignment): pieces, unknown ones kept as written."""
        out = []
        for kind, text in word.parts:
            if kind in ("lit", "sq", "dq"):
                out.append((text, True))
            elif kind == "array":
                out.append(("(" + text + ")", True))
            else:
                value = self.expansion(text)
                out += [(self.written(text), False)] if value is UNKNOWN else self.joined(value)
        self.budget.value(out)
        return out

    @staticmethod
    def written(raw: str) -> str:
        """An unknown expansion as it stays in a field: always with a '$' (backquotes and <(...) rewritten)."""
        if raw.startswith("`"):
            return "$(" + raw.strip("`") + ")"
        return raw if raw.startswith("$") else "$" + raw[1:]

    def fields(self, word: Word) -> list[str]:
        """bash's expansion of a word into fields: known values split where unquoted, unknown ones kept whole."""
        fields: list[list] = [[]]  # each: the field's text pieces; a field with None first exists even if empty
        for kind, text in word.parts:
            if kind in ("lit", "sq", "dq", "array"):
                fields[-1].append(text if kind != "array" else "(" + text + ")")
                if kind in ("sq", "dq"):
                    fields[-1].insert(0, None)
                continue
            value = self.expansion(text)
            if value is UNKNOWN:
                fields[-1].append(self.written(text))
                continue
            quoted = kind == "qvar"
            if isinstance(value, Arr) and not (quoted and ("[*]" in text or text in ("$*", "${*}"))):
                items = value
            else:
                items = [self.joined(value)]
            for n, item in enumerate(items):
                if n:
                    fields.append([None] if quoted else [])
                if quoted:
                    fields[-1][:0] = [None]
                    fields[-1] += [t for t, _ in item]
                    continue
                for piece, known in item:
                    if not known:
                        fields[-1].append(piece)
                        continue
                    # each field a string of its own: paid for before the split makes them (a 16 MiB value of
                    # "a a a ..." would be 8 million strings, 500 MB)
                    self.budget.spend(0, 64 * (piece.count(" ") + piece.count("\t") + piece.count("\n")))
                    parts = re.split(r"[ \t\n]+", piece)
                    fields[-1].append(parts[0])
                    for p in parts[1:]:
                        fields.append([p])
        out = ["".join(p for p in f if p is not None) for f in fields
               if None in f or "".join(p for p in f if p is not None)]
        self.budget.spend(len(out), sum(len(f) + 8 for f in out))
        return out

    # ---- running ----
    def branch(self, *bodies: Node, taken_for_sure: bool = False) -> None:
        """Run each body from the same state (an if's branches, a case's arms, a loop's body that may not run);
        afterwards a variable keeps a value only if every way through agrees on it."""
        before, outcomes = dict(self.vars), [] if taken_for_sure else [dict(self.vars)]
        self.conditional += 1
        try:
            for body in bodies:
                self.budget.spend(2 * len(before))  # the copy, and the comparison after
                self.vars = dict(before)
                try:
                    self.run(body)
                except StopScript:
                    pass
                outcomes.append(self.vars)
        finally:
            self.conditional -= 1
        self.vars = {k: v for k, v in outcomes[0].items()  # `is` first: a value no branch changed is not compared
                     if all((x := o.get(k, UNKNOWN)) is v or x == v for o in outcomes[1:])}
        for o in outcomes:
            for k in o:
                self.vars.setdefault(k, UNKNOWN)

    def run(self, node: Node) -> None:
        kind = node.kind
        if self.top and not self.calls and node.line:
            self.budget.line = node.line
        self.budget.spend(1)
        if kind in ("seq", "group"):
            for child in (node.children if kind == "seq" else node.children[0].children):
                self.run(child)
        elif kind == "andor":
            self.run(node.children[0])
            self.branch(Node("seq", children=node.children[1:]))
        elif kind in ("pipe", "subshell"):  # each part of a pipeline runs in a subshell: its variables stay there
            saved = dict(self.vars)
            for child in node.children:
                try:
                    self.run(child)
                except StopScript:
                    pass
                self.vars = dict(saved)
        elif kind == "if":
            self.run_if(node)
        elif kind == "loop":
            if node.name:
                self.vars[node.name] = UNKNOWN  # one of its words, or what the loop reads
            self.branch(Node("seq", children=node.children))
        elif kind == "case":
            arm = self.case_arm(node)
            if arm is not None:  # the word is known (an array element's index): bash runs the first arm it matches
                self.run(arm)
            else:
                self.branch(*node.children, taken_for_sure=any(c.name.strip() in ("*", "(*") for c in node.children))
        elif kind == "func":
            self.functions[node.name] = node.children[0]
        elif kind == "simple":
            self.simple(node)

    def run_if(self, node: Node) -> None:
        """if/elif/else: a condition this reading can decide (a `[ ... ]` or `test` of known values) picks its branch
        as bash does; from the first one it cannot decide on, every remaining branch may run (branch)."""
        conditions, bodies = node.children[::2], node.children[1::2]
        for n, (condition, body) in enumerate(zip(conditions, bodies)):
            verdict = self.decided(condition)
            if verdict is None:
                pairs = [Node("seq", children=[c, b]) for c, b in zip(conditions[n:], bodies[n:])]
                self.branch(*pairs, taken_for_sure=node.name == "else")
                return
            if verdict:
                self.run(Node("seq", children=[condition, body]))
                return

    TESTS = {"-eq": lambda a, b: a == b, "-ne": lambda a, b: a != b, "-lt": lambda a, b: a < b,
             "-le": lambda a, b: a <= b, "-gt": lambda a, b: a > b, "-ge": lambda a, b: a >= b}

    def decided(self, condition: Node) -> bool | None:
        """A condition's outcome where this reading knows it: no command (an else), or one `[ A OP B ]` / `test`
        of known words (-eq ... -ge between integers, = == != between strings, -z / -n); None otherwise."""
        if not condition.children:
            return True
        if len(condition.children) != 1 or condition.children[0].kind != "simple":
            return None
        words = condition.children[0].words
        values = [self.text_of(self.scalar(w)) for w in words[:6]]
        if None in values or len(words) > 5 or not values or values[0] not in ("[", "test"):
            return None
        args = values[1:-1] if values[0] == "[" and values[-1] == "]" else values[1:] if values[0] == "test" else None
        if args is None:
            return None
        if len(args) == 2 and args[0] in ("-z", "-n"):
            return (args[1] == "") == (args[0] == "-z")
        if len(args) == 3 and args[1] in ("=", "==", "!="):
            return (args[0] == args[2]) != (args[1] == "!=")
        if len(args) == 3 and args[1] in self.TESTS and all(re.fullmatch(r"-?\d{1,18}", a) for a in args[::2]):
            return self.TESTS[args[1]](int(args[0]), int(args[2]))
        return None

    def case_arm(self, node: Node) -> Node | None:
        """The arm bash runs for a case whose word is known: the first whose pattern matches (glob, as fnmatch reads
        it), or an empty one; None where the word or a pattern before the match is not known."""
        import fnmatch
        value = self.text_of(self.scalar(node.words[0])) if node.words else None
        if value is None:
            return None
        for arm in node.children:
            for pattern in arm.name.split("|"):
                pattern = pattern.strip().lstrip("(")
                if "$" in pattern or "`" in pattern:
                    return None
                if fnmatch.fnmatchcase(value, pattern):
                    return arm
        return Node("seq")

    ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)(\[[^\]]*\])?(\+?)=")

    def split_assignment(self, word: Word) -> tuple[str, str, Word] | None:
        kind, text = word.parts[0]
        m = self.ASSIGNMENT.match(text) if kind == "lit" else None
        if not m:
            return None
        rest = [("lit", text[m.end():])] if text[m.end():] else []
        return m.group(1), m.group(3), Word(rest + word.parts[1:], word.line)

    def assign(self, name: str, append: str, value_word: Word) -> None:
        if value_word.parts and value_word.parts[0][0] == "array":
            body = value_word.parts[0][1]
            self.budget.spend(1, len(body))
            if body not in self.arrays:  # lexed once, its steps charged (a function assigning it is called often)
                self.arrays[body] = self.lex(body).tokens
            inner = self.arrays[body]
            value = Arr(self.known(f) if "$" not in f else [(f, False)]
                        for w in inner if isinstance(w, Word) for f in self.fields(w))
        else:
            value = self.scalar(value_word)
        old = self.vars.get(name, UNKNOWN)
        if append and old is not UNKNOWN:
            value = Arr(old + value) if isinstance(old, Arr) or isinstance(value, Arr) else old + value
            self.budget.value(value)
        elif append:
            value = UNKNOWN
        self.vars[name] = value

    def simple(self, node: Node) -> None:
        words, prefix = list(node.words), []
        while words and (a := self.split_assignment(words[0])):
            prefix.append(a)
            words.pop(0)
        if not words:
            for name, append, value in prefix:
                self.assign(name, append, value)
            return
        fields = [f for w in words for f in self.fields(w)]
        if not fields:
            return
        cmd, args = fields[0], fields[1:]
        if cmd in ("export", "declare", "typeset", "local", "readonly"):
            for w in words[1:]:
                a = self.split_assignment(w)
                if a:
                    self.assign(*a)
                if cmd == "export" or (cmd != "local" and "-x" in args):
                    self.exported.add(a[0] if a else w.text)
            return
        if cmd == "unset":
            for name in args:
                self.vars[name] = []
            return
        if cmd in ("source", ".") and args:
            self.sourced.append(args[0])
            return
        if cmd == "read":
            for name in args:
                if name.isidentifier():
                    self.vars[name] = UNKNOWN
            return
        if cmd == "set" and args[:1] == ["--"]:
            self.positional = [[(a, "$" not in a)] for a in args[1:]]
            return
        if cmd == "shift" and self.positional:
            self.shift(args)
            return
        if cmd == "exit":
            if not self.conditional:
                raise StopScript
            return
        if cmd == "eval":
            self.eval(args)
            return
        if cmd in self.functions and self.calls < self.MAX_CALLS:
            saved, self.positional = self.positional, [[(a, "$" not in a)] for a in args]
            self.calls += 1
            self.conditional += 1
            try:
                self.run(self.functions[cmd])
            finally:
                self.positional, self.calls, self.conditional = saved, self.calls - 1, self.conditional - 1
            return
        env = {name: self.text_of(self.scalar(value)) for name, _, value in prefix if name.startswith(SRUN_READS)}
        exported = {n: self.text_of(self.vars.get(n, UNKNOWN)) for n in self.srun_exported()}
        self.sink(Ran(fields, env, node.line, self.conditional > 0, {**exported, **env}))

    def srun_exported(self) -> list[str]:
        """The exported variables srun reads (SRUN_READS), looked up again only when a name was exported since: 10,000
        exported names looked through at each of 15,000 commands took 3.6 s."""
        if self._srun[0] != len(self.exported):  # names are only ever added
            self._srun = (len(self.exported), [n for n in self.exported if n.startswith(SRUN_READS)])
        return self._srun[1]

    def shift(self, args: list[str]) -> None:
        """shift [N]: N read bounded (ASCII digits; `shift 99999...` is no traceback); the list is copied, paid for."""
        self.budget.spend(len(self.positional) // 100)
        n = whole_number(args[0]) if args else 1
        self.positional = self.positional[1 if n is None else n:]

    def eval(self, args: list[str]) -> None:
        """eval: its words as a script; an eval of itself goes as deep as functions do (MAX_CALLS), no deeper."""
        if self.calls < self.MAX_CALLS:
            self.calls += 1
            try:
                self.run_text(" ".join(args))
            finally:
                self.calls -= 1

    def run_text(self, text: str) -> None:
        """A piece of shell given as a string (eval, bash -c): parsed and run here."""
        self.budget.spend(1, len(text))
        lexer = self.lex(text)
        self.run(ShellParser(lexer.tokens).parse_list())

    def run_script(self, text: str) -> ShellLexer:
        """Run the script; where the budget runs out (TooComplex), `cut` says where and the commands so far stand."""
        lexer = ShellLexer(text).run()
        parser = ShellParser(lexer.tokens)
        tree = parser.parse_list()
        try:
            self.run(tree)
        except StopScript:
            pass
        except TooComplex as exc:
            self.cut = exc
        except RecursionError:  # functions calling functions, each nesting commands: deeper than Python goes
            self.cut = TooComplex(self.budget.line, "functions and commands nested too deep")
        if parser.cut and not (self.cut and self.cut.line <= parser.cut):
            self.cut = TooComplex(parser.cut, f"commands nested more than {parser.MAX_DEPTH} deep")
        return lexer
