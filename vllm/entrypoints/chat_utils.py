"""Chat-template helpers shared by the server's options and its chat handler."""
from __future__ import annotations

# Characters that mark a --chat-template value as a template rather than a file path.
_TEMPLATE_MARKS = ("{", "}", "\n")


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's path (its text is the template) or the template itself.
    Raises ValueError for a value that looks like a path but cannot be read."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except OSError as exc:
        if not any(mark in value for mark in _TEMPLATE_MARKS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it "
                             f"cannot be read ({exc.strerror or exc}); give a readable Jinja "
                             f"file or the template text itself") from None
        template = value
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template is not a valid Jinja template: {exc.message} "
                         f"(line {exc.lineno})") from None
    return template
