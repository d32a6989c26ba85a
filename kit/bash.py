"""bash's grammar, far enough to check a job script: the lexer (quotes, expansions, operators, here-documents) and the
parser (which commands run, in which order, under which conditions), within a budget of tokens. kit.shell runs what
they read in the mind. Owns: the lexer and the parser, TooComplex. Imports: nothing of the kit.
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

    def __init__(self, text: str, limit: int | None = None) -> None:
        self.s, self.i, self.line = text, 0, 1
        self.limit = self.MAX_TOKENS if limit is None else limit  # a nested lexer's: what is left of the budget
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
        if self.count < self.limit:
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
