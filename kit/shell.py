"""bash, far enough to check a job script: the lexer (quotes, expansions, operators, here-documents), the
grammar (which commands run, in which order, under which conditions), and a run in the mind (what each variable
holds at each command), within a work budget. Owns: the shell reading. Imports: nothing of the kit.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field



# -- bash's words: quotes, expansions, operators and here-documents, as bash reads them --

@dataclass
class Word:
    """One shell word as pieces (kind, text): 'lit' unquoted text, 'sq' single-quoted, 'dq' double-quoted text, 'var'
    an unquoted $expansion (bash splits its value into fields), 'qvar' one inside double quotes, 'array' the inside of
    NAME=( ... )."""
    parts: list[tuple[str, str]]
    line: int

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.parts)

    @property
    def plain(self) -> bool:
        return all(k == "lit" for k, _ in self.parts)


@dataclass
class HereDoc:
    first: int  # the lines of its body
    last: int
    delimiter: str


OPERATORS = ("&&", "||", ";;&", ";;", ";&", "|&", ";", "|", "&", "(", ")")

REDIRECTIONS = ("<<<", "<<-", "<<", "&>>", "&>", ">>", ">&", "<&", "<>", ">|", "<", ">")

BREAK = set(" \t\r\n;&|()<>")


# Runs of characters with nothing to decide in them, taken whole (a regular expression, not a Python loop per
# character: a 4 MiB word or string is read in milliseconds): in a word, inside double quotes, inside $( ) and ${ },
# blank and comment lines after a newline, the text of `...` and $'...'
_PLAIN = re.compile(r"[^ \t\r\n;&|()<>\\'\"$`]+")

_DQ_PLAIN = re.compile(r"[^\"\\$`]+")

_BALANCED_STOP = {"(": re.compile(r"[\\'\"()]"), "{": re.compile(r"[\\{}]")}

_COMMAND_LINE = re.compile(r"^[ \t\r]*[^ \t\r\n#]", re.M)  # the next line that is not blank or a comment

_BACKQUOTED = re.compile(r"(?:[^`\\]|\\.)*", re.S)

_ANSI_C = re.compile(r"(?:[^'\\]|\\.)*", re.S)

_REDIRECTION_START = re.compile(r"\d*[<>&]")

_BLANKS = re.compile(r"[ \t\r]+")


class TooComplex(Exception):
    """The reading of a script spent its budget at `line` (ShellBudget, MAX_TOKENS, MAX_DIRECTIVES): what was read
    up to there stands, the rest is not followed."""

    def __init__(self, line: int, what: str) -> None:
        super().__init__(f"line {line}: {what}")
        self.line, self.what = line, what


class ShellLexer:
    """bash's tokens: Word, or (operator, line) for control operators and newlines. Redirections and their targets
    are dropped (they are not arguments); here-document bodies are set aside in `heredocs`, never read as commands.
    At most MAX_TOKENS steps are taken (a token, a piece of a word, a run of blanks: each token costs a few hundred
    bytes and the parser's and runner's time): past them `cut` is the line where reading stopped, and the tokens so
    far stand. Blank and comment lines make one newline token."""

    MAX_TOKENS = 50_000

    def __init__(self, text: str) -> None:
        self.s, self.i, self.line = text, 0, 1
        self.tokens: list = []
        self.heredocs: list[HereDoc] = []
        self.pending: list[tuple[str, bool]] = []
        self.unclosed: tuple[int, str] | None = None  # where a quote opens that never closes
        self.cut: int | None = None  # where MAX_TOKENS stopped the reading
        self.count = 0  # tokens, and pieces of words (a word of a million $X is a million pieces)

    def run(self) -> "ShellLexer":
        s = self.s
        while self.i < len(s) and not self.spent():
            self.count += 1
            c = s[self.i]
            if c in " \t\r":
                self.i = _BLANKS.match(s, self.i).end()
            elif s.startswith("\\\n", self.i):
                self.i, self.line = self.i + 2, self.line + 1
            elif c == "\n":
                if not (self.tokens and self.tokens[-1].__class__ is tuple and self.tokens[-1][0] == "\n"):
                    self.tokens.append(("\n", self.line))
                self.i, self.line = self.i + 1, self.line + 1
                self.bodies()
                found = _COMMAND_LINE.search(s, self.i)  # the blank and comment lines that follow: skipped at once
                end = found.start() if found else max(self.i, s.rfind("\n") + 1)
                self.line += s.count("\n", self.i, end)
                self.i = end
            elif c == "#":
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            elif s.startswith("((", self.i):  # (( arithmetic )): a command that is no launch
                end = self.balanced(self.i, "(", ")")
                self.tokens.append(Word([("var", "$" + s[self.i:end])], self.line))
                self.line += s.count("\n", self.i, end)
                self.i = end
            elif self.redirection():
                continue
            elif c in ";&|()" or (c in "<>" and not s.startswith("(", self.i + 1)):
                op = next((o for o in OPERATORS if s.startswith(o, self.i)), c)
                self.tokens.append((op, self.line))
                self.i += len(op)
            else:
                self.word()
        if self.cut:  # the command the reading stopped in is left out whole (half a trainer line would mislead)
            while self.tokens and not (self.tokens[-1].__class__ is tuple and self.tokens[-1][0] == "\n"):
                dropped = self.tokens.pop()
                self.cut = dropped.line if isinstance(dropped, Word) else dropped[1]
        return self

    def spent(self) -> bool:
        """Past MAX_TOKENS: the reading stops here (the rest of the text is left)."""
        if self.count < self.MAX_TOKENS:
            return False
        self.cut, self.i = self.cut or self.line, len(self.s)
        return True

    def redirection(self) -> bool:
        s, j = self.s, self.i
        if not _REDIRECTION_START.match(s, j):  # most tokens: no redirection, decided in one step
            return False
        while j < len(s) and s[j].isdigit():
            j += 1
        op = next((r for r in REDIRECTIONS if s.startswith(r, j)), None)
        if op is None or (j > self.i and op.startswith("&")) or s.startswith("(", j + len(op)):
            return False
        self.i = j + len(op)
        while self.i < len(s) and s[self.i] in " \t":
            self.i += 1
        target = self.word(emit=False)
        if op in ("<<", "<<-") and target is not None:
            self.pending.append((target.text, op == "<<-"))
        return True

    def bodies(self) -> None:
        """The bodies of the here-documents announced on the line that just ended, each up to its delimiter line
        (found by a regular expression: a body of a million lines costs no Python loop)."""
        for delimiter, strip in self.pending:
            first, s = self.line, self.s
            if self.i >= len(s):
                self.heredocs.append(HereDoc(first, first - 1, delimiter))
                continue
            end = re.compile("^" + ("\t*" if strip else "") + re.escape(delimiter) + "$", re.M).search(s, self.i)
            stop = end.end() if end else len(s)
            lines = s.count("\n", self.i, stop) + 1
            self.i, self.line = stop + 1, self.line + lines
            self.heredocs.append(HereDoc(first, self.line - 1, delimiter))
        self.pending = []

    def word(self, emit: bool = True) -> Word | None:
        s, parts, lit, line = self.s, [], [], self.line

        def flush() -> None:
            if lit:
                parts.append(("lit", "".join(lit)))
                lit.clear()
        while self.i < len(s) and not self.spent():
            self.count += 1
            c = s[self.i]
            if c == "(" and not parts and re.fullmatch(r"[A-Za-z_]\w*\+?=", "".join(lit)):  # NAME=( array )
                flush()
                end = self.balanced(self.i, "(", ")")
                parts.append(("array", s[self.i + 1:end - 1]))
                self.line += s.count("\n", self.i, end)
                self.i = end
            elif c in BREAK and not (c in "<>" and s.startswith("(", self.i + 1)):
                break
            elif c == "\\":
                if s.startswith("\\\n", self.i):
                    self.line += 1
                else:
                    lit.append(s[self.i + 1:self.i + 2])
                self.i += 2
            elif c == "'":
                end = s.find("'", self.i + 1)
                if end < 0:
                    self.unclosed = self.unclosed or (self.line, "'")
                    end = len(s)
                flush()
                parts.append(("sq", s[self.i + 1:end]))
                self.line += s.count("\n", self.i, end)
                self.i = end + 1
            elif s.startswith("$'", self.i):
                end = _ANSI_C.match(s, self.i + 2).end()
                flush()
                parts.append(("sq", s[self.i + 2:end].replace("\\n", "\n").replace("\\t", "\t")))
                self.i = end + 1
            elif c == '"':
                flush()
                self.double_quoted(parts)
            elif c in "$`<>":
                flush()
                parts.append(("var", self.expansion()))
            else:
                end = _PLAIN.match(s, self.i).end()
                lit.append(s[self.i:end])
                self.i = end
        flush()
        if not parts:
            return None
        w = Word(parts, line)
        if emit:
            self.tokens.append(w)
        return w

    def double_quoted(self, parts: list) -> None:
        s, text = self.s, []
        self.i += 1
        while self.i < len(s) and s[self.i] != '"' and not self.spent():
            self.count += 1
            c = s[self.i]
            if c == "\\" and s[self.i + 1:self.i + 2] in ('$', '`', '"', '\\', '\n'):
                text.append(s[self.i + 1] if s[self.i + 1] != "\n" else "")
                self.line += s[self.i + 1] == "\n"
                self.i += 2
            elif c == "`" or (c == "$" and re.match(r"[{(\w@*#?$!-]", s[self.i + 1:self.i + 2] or " ")):
                if text:
                    parts.append(("dq", "".join(text)))
                    text = []
                parts.append(("qvar", self.expansion()))
            elif c in "\\$":
                text.append(c)
                self.i += 1
            else:
                end = _DQ_PLAIN.match(s, self.i).end()
                self.line += s.count("\n", self.i, end)
                text.append(s[self.i:end])
                self.i = end
        if self.i >= len(s) and self.cut is None:
            self.unclosed = self.unclosed or (self.line, '"')
        if text or not parts or parts[-1][0] != "qvar":
            parts.append(("dq", "".join(text)))
        self.i += 1

    def expansion(self) -> str:
        """$name, ${...}, $(...), $((...)), `...`, <(...) as written, balanced, quotes respected."""
        s, start = self.s, self.i
        if s[self.i] == "`":
            self.i = _BACKQUOTED.match(s, self.i + 1).end() + 1
        elif s[self.i] in "<>":
            self.i = self.balanced(self.i + 1, "(", ")")
        elif s.startswith("${", self.i):
            self.i = self.balanced(self.i + 1, "{", "}")
        elif s.startswith("$(", self.i):
            self.i = self.balanced(self.i + 1, "(", ")")
        else:
            self.i = re.compile(r"\$(?:[A-Za-z_]\w*|[0-9@*#?$!-])?").match(s, self.i).end()
        self.line += s.count("\n", start, self.i)
        return s[start:self.i]

    def balanced(self, at: int, open_: str, close: str) -> int:
        """The index after the bracket that closes the one at `at` (quoted text skipped)."""
        s, depth, j, stop = self.s, 0, at, _BALANCED_STOP[open_]
        while j < len(s):
            self.count += 1  # a bracket or quote: a step of the budget (a million '$(' never closed)
            if self.spent():
                return len(s)
            m = stop.search(s, j)
            if m is None:
                return len(s)
            j = m.start()
            c = s[j]
            if c == "\\":
                j += 2
                continue
            if c in "'\"":
                j = s.find(c, j + 1)
                j = len(s) if j < 0 else j + 1
                continue
            depth += (c == open_) - (c == close)
            j += 1
            if depth == 0:
                return j
        return len(s)


# -- bash's grammar, far enough to know which commands run, in which order, under which conditions --

@dataclass
class Node:
    kind: str  # simple, seq, andor, pipe, if, loop, case, group, subshell, func
    line: int = 0
    words: list = field(default_factory=list)  # simple: its words; loop: the words after 'in'; case: the word
    children: list = field(default_factory=list)
    name: str = ""  # the loop's variable, the function's name


class ShellParser:
    """Commands as a tree. Compound commands nest at most MAX_DEPTH deep (a real script nests a few; each level is a
    few Python frames here and in ShellRun): past that the parse stops and `cut` is the line it reached."""

    MAX_DEPTH = 40

    def __init__(self, tokens: list) -> None:
        self.t, self.i = tokens, 0
        self.depth, self.cut = 0, None

    def peek(self, ahead: int = 0):
        return self.t[self.i + ahead] if self.i + ahead < len(self.t) else None

    def op(self, *names: str, ahead: int = 0) -> bool:
        tok = self.peek(ahead)
        return isinstance(tok, tuple) and tok[0] in names

    def keyword(self, *names: str) -> bool:
        tok = self.peek()
        return isinstance(tok, Word) and tok.plain and tok.text in names

    def skip(self, *ops: str) -> None:
        while self.op("\n", *ops):
            self.i += 1

    def expect(self, name: str) -> None:
        self.skip(";")
        if self.keyword(name):
            self.i += 1

    def parse_list(self, stop: tuple[str, ...] = ()) -> Node:
        self.depth += 1
        try:
            return self._parse_list(stop)
        finally:
            self.depth -= 1

    def _parse_list(self, stop: tuple[str, ...]) -> Node:
        seq = Node("seq")
        if self.depth > self.MAX_DEPTH:
            tok = self.peek()
            self.cut = self.cut or (tok.line if isinstance(tok, Word) else tok[1] if tok else 0)
            self.i = len(self.t)
            return seq
        while True:
            self.skip(";", "&")
            if self.peek() is None or self.keyword(*stop) or self.op(")", ";;", ";&", ";;&"):
                return seq
            start = self.i
            seq.children.append(self.parse_andor())
            if self.i == start:  # a token no rule takes: skip it rather than loop
                self.i += 1

    def parse_andor(self) -> Node:
        node = Node("andor", children=[self.parse_pipeline()])
        while self.op("&&", "||"):
            self.i += 1
            self.skip()
            node.children.append(self.parse_pipeline())
        return node if len(node.children) > 1 else node.children[0]

    def parse_pipeline(self) -> Node:
        while self.keyword("!"):
            self.i += 1
        node = Node("pipe", children=[self.parse_command()])
        while self.op("|", "|&"):
            self.i += 1
            self.skip()
            node.children.append(self.parse_command())
        return node if len(node.children) > 1 else node.children[0]

    def parse_command(self) -> Node:
        tok = self.peek()
        line = tok.line if isinstance(tok, Word) else (tok[1] if tok else 0)
        if self.op("("):
            self.i += 1
            body = self.parse_list()
            self.i += self.op(")")
            return Node("subshell", line, children=[body])
        if isinstance(tok, Word) and tok.plain and tok.text in ("if", "for", "select", "while", "until", "case",
                                                                 "{", "[[", "function"):
            return getattr(self, "parse_" + {"{": "group", "[[": "test", "select": "for"}.get(tok.text, tok.text))(line)
        words = []
        while isinstance(self.peek(), Word):
            words.append(self.peek())
            self.i += 1
        if len(words) == 1 and self.op("(") and self.op(")", ahead=1):  # name() { ...; }
            self.i += 2
            return self.parse_function_body(words[0].text, line)
        return Node("simple", line, words=words)

    def parse_if(self, line: int) -> Node:
        self.i += 1
        node = Node("if", line)
        while True:
            node.children.append(self.parse_list(("then",)))
            self.expect("then")
            node.children.append(self.parse_list(("elif", "else", "fi")))
            if not self.keyword("elif"):
                break
            self.i += 1
        if self.keyword("else"):
            self.i += 1
            node.children += [Node("seq"), self.parse_list(("fi",))]
            node.name = "else"
        self.expect("fi")
        return node

    def parse_for(self, line: int) -> Node:
        self.i += 1
        node = Node("loop", line)
        if isinstance(self.peek(), Word):
            node.name = self.peek().text if self.peek().plain and self.peek().text.isidentifier() else ""
            self.i += 1
        self.skip(";")
        if self.keyword("in"):
            self.i += 1
            while isinstance(self.peek(), Word):
                node.words.append(self.peek())
                self.i += 1
        self.expect("do")
        node.children = [self.parse_list(("done",))]
        self.expect("done")
        return node

    def parse_while(self, line: int) -> Node:
        self.i += 1
        node = Node("loop", line, children=[self.parse_list(("do",))])
        self.expect("do")
        node.children.append(self.parse_list(("done",)))
        self.expect("done")
        return node

    parse_until = parse_while

    def parse_case(self, line: int) -> Node:
        self.i += 1
        node = Node("case", line)
        if isinstance(self.peek(), Word):
            node.words.append(self.peek())
            self.i += 1
        self.expect("in")
        while True:
            self.skip(";;", ";&", ";;&")
            if self.peek() is None or self.keyword("esac"):
                self.i += self.peek() is not None
                return node
            patterns = []
            while self.peek() is not None and not self.op(")"):
                if isinstance(self.peek(), Word):
                    patterns.append(self.peek().text)
                self.i += 1
            self.i += 1
            arm = self.parse_list(("esac",))
            arm.name = "|".join(patterns)
            node.children.append(arm)

    def parse_group(self, line: int) -> Node:
        self.i += 1
        body = self.parse_list(("}",))
        self.expect("}")
        return Node("group", line, children=[body])

    def parse_test(self, line: int) -> Node:
        while self.peek() is not None and not (isinstance(self.peek(), Word) and self.peek().text == "]]"):
            self.i += 1
        self.i += 1
        return Node("simple", line, words=[Word([("lit", "[[")], line)])

    def parse_function(self, line: int) -> Node:
        self.i += 1
        name = self.peek().text if isinstance(self.peek(), Word) else ""
        self.i += 1
        if self.op("(") and self.op(")", ahead=1):
            self.i += 2
        return self.parse_function_body(name, line)

    def parse_function_body(self, name: str, line: int) -> Node:
        self.skip()
        return Node("func", line, children=[self.parse_command()], name=name)


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
    few tenths of a second and under 100 MB."""

    STEPS = 50_000
    BYTES = 32 * 2 ** 20

    def __init__(self) -> None:
        self.steps = self.bytes = 0
        self.line = 0  # the script's line being run (inside a function: the line that called it)

    def spend(self, steps: int = 0, nbytes: int = 0) -> None:
        self.steps += steps
        self.bytes += nbytes
        if self.steps > self.STEPS:
            raise TooComplex(self.line, f"more than {self.STEPS} commands and expansions to follow")
        if self.bytes > self.BYTES:
            raise TooComplex(self.line, f"its variables' values grow past {self.BYTES >> 20} MiB")

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
        self.cut: TooComplex | None = None  # where the budget stopped the reading
        self.vars: dict = dict(variables)
        self.exported = set(variables) if exported is None else set(exported)
        self.functions: dict[str, Node] = {}
        self.positional: list | None = None  # the script's own $1 ... are unknown (sbatch job.slurm ARGS)
        self.sink, self.conditional, self.calls, self.nesting = sink, 0, 0, 0
        self.sourced: list[str] = []

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
            k = int(name)
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
        """bash's integer $(( )) with the variables this reading knows; None when it cannot tell."""
        import ast
        self.budget.spend(1)
        if len(expr) > self.MAX_ARITHMETIC:
            return None

        def value(m: re.Match) -> str:
            text = self.text_of(self.lookup(m.group(1) or m.group(2)))
            if text is None or not re.fullmatch(r"\s*-?\d*\s*", text):
                raise ValueError(m.group(0))
            return f"({text.strip() or '0'})"
        try:
            src = re.sub(r"\$\{?([A-Za-z_]\w*)\}?|\b([A-Za-z_]\w*)\b", value, expr)
            tree = ast.parse(src.replace("/", "//").strip() or "0", mode="eval")
        except (ValueError, SyntaxError):
            return None
        allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv,
                   ast.Mod, ast.USub, ast.UAdd)
        if not all(isinstance(n, allowed) and not (isinstance(n, ast.Constant) and type(n.value) is not int)
                   for n in ast.walk(tree)):
            return None
        try:  # only integer literals and + - * // % are left: nothing here can run code or grow without bound
            result = eval(compile(tree, "<arithmetic>", "eval"), {"__builtins__": {}})
        except ArithmeticError:
            return None
        return result if abs(result) < 2 ** 63 else None

    def expansion(self, raw: str):
        """The value of one expansion as written ($X, ${X:-d}, ${A[1]}, $((1+2)), ...), or UNKNOWN."""
        self.budget.spend(1)
        if raw.startswith("$((") and raw.endswith("))"):
            n = self.arith(raw[3:-2])
            return UNKNOWN if n is None else self.known(str(n))
        m = re.fullmatch(r"\$(?:([A-Za-z_]\w*|[0-9@*#])|\{(#?)([A-Za-z_]\w*|[0-9]+|[@*#])(?:\[([^\]]*)\])?"
                         r"(?:(:?[-=+?])(.*))?\})", raw, re.S)
        if raw == "$":
            return self.known("$")
        sliced = re.fullmatch(r"\$\{([@*])(?::(\d+))(?::(\d+))?\}", raw)  # ${@:2}, ${@:2:3}: positional slices
        if sliced:
            args = self.lookup(sliced.group(1))
            if args is UNKNOWN:
                return UNKNOWN
            start = int(sliced.group(2)) - 1 if int(sliced.group(2)) else 0
            end = start + int(sliced.group(3)) if sliced.group(3) else None
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
        word = ShellLexer('"' + text.replace('"', '\\"') + '"').word(emit=False)
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
            self.budget.spend(1, len(value_word.parts[0][1]))
            inner = ShellLexer(value_word.parts[0][1]).run().tokens
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
            self.positional = self.positional[int(args[0]) if args and args[0].isdigit() else 1:]
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
        exported = {n: self.text_of(self.vars.get(n, UNKNOWN)) for n in self.exported if n.startswith(SRUN_READS)}
        self.sink(Ran(fields, env, node.line, self.conditional > 0, {**exported, **env}))

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
        lexer = ShellLexer(text).run()
        self.budget.spend(len(lexer.tokens))
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
