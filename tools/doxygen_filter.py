#!/usr/bin/env python3
"""Doxygen INPUT_FILTER: lets doxygen read membound's plain `//` comments as documentation.

Prints the file named by argv[1], one output line per input line (so warnings point at the real
lines), with:
  - the file's opening `//` block turned into a `///` block that ends with `\\file`;
  - a `//` comment block directly above a declaration turned into `///` (above `int a, b;`, for
    each of the names);
  - a trailing comment after a declaration (`int x = 0;  // why`, `int f() { ... }  // why`)
    turned into `///<`, and the comment lines continuing it under the same column too;
  - comment text escaped, outside `code spans` and "quotes", so that `<S>`, `\\`, `@`, `#`, `%`
    or `&` is printed and not read as HTML or a doxygen command (and `--` not as a dash).
Code (a line's text before its comment), comments inside function bodies, section headings
(`// ---- Forward ----`) and comments not followed by a declaration (but by a blank line, a
preprocessor line, a closing brace, an access specifier or a static_assert) are left byte for
byte alone.
"""
import re
import sys

ESCAPED = re.compile(r'([\\@<>&#%$])')
QUOTED = re.compile(r'("[^"]*")')
DASHES = re.compile(r'(?<!-)(-{2,3})(?!-)')  # `--flag` stays two dashes, not an en dash
SCOPE_HEAD = re.compile(r'^[^(]*?\b(class|struct|union|enum|namespace)\b')
SECTION = re.compile(r'\s*-{3}')  # `// ---- Forward ----`: a heading over several declarations
MACRO_LINE = re.compile(r'\s*[A-Z][A-Z0-9_]*\s*$')  # MEMBOUND_NAMESPACE_BEGIN and the like
NOT_DECLARATIONS = ('#', '}', 'static_assert', 'MEMBOUND_NAMESPACE_')  # what a comment may precede
ACCESS = re.compile(r'\b(?:public|protected|private)\s*:(?!:)')


def split_comment(line):
    """(code, comment text after `//`) or (line, None); `//` in a literal is code."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == '\\':
                i += 1
            elif c == quote:
                quote = None
        elif c in '"\'':
            # A digit separator (1'000'000) is not a character literal.
            if not (c == "'" and i and line[i - 1].isalnum() and line[i + 1:i + 2].isalnum()):
                quote = c
        elif line.startswith('//', i):
            return line[:i], line[i + 2:]
        elif line.startswith('/*', i):
            end = line.find('*/', i + 2)
            i = len(line) if end < 0 else end + 1
        i += 1
    return line, None


def without_literals(code):
    """The code with string and character literals and /* */ comments blanked out."""
    code = re.sub(r'/\*.*?\*/', ' ', code)
    return re.sub(r'"(?:\\.|[^"\\])*"|(?<![\w])\'(?:\\.|[^\'\\])*\'', '""', code)


def escape(text, in_code):
    """Escapes doxygen's special characters outside `code spans` (one may go on to the next line:
    in_code says if one is open) and "quotes", which doxygen prints as they are."""
    def plain(q):
        return q if QUOTED.fullmatch(q) else DASHES.sub(r'\\\1', ESCAPED.sub(r'\\\1', q))
    parts = text.split('`')
    for k, part in enumerate(parts):
        if k:
            in_code = not in_code
        if not in_code:
            parts[k] = ''.join(plain(q) for q in QUOTED.split(part))
    return '`'.join(parts), in_code


def declares_several(code):
    """Whether a declaration names several members (`int a = 0, b = 0;`): a top-level comma."""
    bare = without_literals(code).strip()
    if not bare.endswith(';') or re.match(r'(using|typedef|friend|return)\b', bare):
        return False
    depth = 0
    for c in bare:
        depth += (c in '([{<') - (c in ')]}>')
        if c == ',' and depth == 0:
            return True
    return False


def strip_template_head(code):
    """`template <...> struct x` -> ` struct x`: `class` in a parameter list is not a class head."""
    m = re.match(r'\s*template\s*<', code)
    if not m:
        return code
    depth, i = 1, m.end()
    while i < len(code) and depth:
        depth += {'<': 1, '>': -1}.get(code[i], 0)
        i += 1
    return code[i:]


def main():
    with open(sys.argv[1], encoding='utf-8') as f:
        lines = f.read().split('\n')
    out = list(lines)
    parts = [split_comment(l) for l in lines]
    kinds = ['code' if c.strip() else 'blank' if t is None else 'comment' for c, t in parts]

    # The opening block documents the file: `\file` at the end of its first line (a name would
    # follow it on the same line), so no line is added.
    n = 0
    in_code = False
    while n < len(lines) and kinds[n] == 'comment' and lines[n].startswith('//'):
        text, in_code = escape(lines[n][2:], in_code)
        out[n] = '///' + text + (' \\file' if n == 0 else '')
        n += 1

    scopes = []        # one entry per open brace: True where a declaration may follow
    pending = ''       # code since the last ; { or }: the head of the next brace
    trailing_col = -1  # column of the `///<` comment on the line above, or -1
    group_open = False  # a member group opened above the declaration on the next code line
    in_code = False
    for i in range(n, len(lines)):
        code, comment = parts[i]
        at_declaration_scope = all(scopes)
        if kinds[i] == 'comment':
            col = lines[i].index('//')
            # The block documents what follows only if a declaration follows it.
            j = i
            while j < len(lines) and kinds[j] == 'comment':
                j += 1
            nxt = parts[j][0].strip() if j < len(lines) else ''
            declaration_follows = (j < len(lines) and kinds[j] == 'code' and not ACCESS.match(nxt)
                                   and not nxt.startswith(NOT_DECLARATIONS))
            if at_declaration_scope and col == trailing_col:
                text, in_code = escape(comment, in_code)
                out[i] = lines[i][:col] + '///<' + text
                continue
            trailing_col = -1
            if (at_declaration_scope and declaration_follows and not comment.startswith('/')
                    and not SECTION.match(comment)):
                text, in_code = escape(comment, in_code)
                first = i == 0 or kinds[i - 1] != 'comment'
                # Doxygen documents only the first name of `int a, b;`: a member group around
                # it hands that documentation to the others too (DISTRIBUTE_GROUP_DOC). The block
                # becomes one /** */ comment: the group's opener would split a /// block in two.
                group_open = group_open or (first and declares_several(nxt))
                if group_open:
                    out[i] = (lines[i][:col] + ('/**@{*/ /**' if first else '   ') +
                              text.replace('*/', '*\\/') + (' */' if j == i + 1 else ''))
                else:
                    out[i] = lines[i][:col] + '///' + text
            continue
        trailing_col = -1
        in_code = False
        if kinds[i] == 'blank' or code.lstrip().startswith('#'):
            continue
        if MACRO_LINE.match(code):
            pending = ''
            continue
        # A comment after a declaration, an enumerator or a one-line definition documents it.
        bare = without_literals(code).rstrip()
        one_line_body = bare.endswith('}') and 0 < bare.count('{') == bare.count('}')
        if (comment is not None and at_declaration_scope and not comment.startswith('/')
                and (bare.endswith((';', ',')) or one_line_body)):
            text, in_code = escape(comment, in_code)
            out[i] = code + '///<' + text
            trailing_col = len(code)
        if group_open:  # the group ends after the declaration and its comment (then a /**< */)
            if trailing_col >= 0:
                out[i] = code + '/**<' + text.replace('*/', '*\\/') + ' */'
            out[i] += '  /**@}*/'
            group_open, trailing_col = False, -1
        # Follow the braces: a class, struct, union, enum or namespace body holds declarations,
        # any other brace (a function body, an initializer, a lambda) holds code.
        for c in bare:
            if c == '{':
                head = ACCESS.sub('', pending)
                scopes.append(bool(SCOPE_HEAD.search(strip_template_head(head))))
                pending = ''
            elif c == '}':
                if scopes:
                    scopes.pop()
                pending = ''
            elif c == ';':
                pending = ''
            else:
                pending += c
        pending += ' '
    sys.stdout.buffer.write('\n'.join(out).encode('utf-8'))


if __name__ == '__main__':
    main()
