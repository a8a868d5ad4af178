"""MkDocs hook: three fixes to the site's search, made in Material's search worker as built.

Readers paste a whole error message into the search box. Material for MkDocs (9.8.2) searches
with lunr 2.3.9 in a web worker, and three things made a pasted message miss its entry on
"Find your error" (measured on this site's index; tests/site/test_find_your_error.py runs the
search box in Chromium and Material's worker under Node):

1. lunr's `TokenSet.toString` joins each edge's label and the next node's id with nothing in
   between, so once ids have several digits two different nodes can get one key (label `1`
   and node 2345, or label `1`, node 2, label `3`, node 45), and building the index merges
   them. Here it dropped the word `distributed_c10d` and invented `distributed_c10` and
   `distributed_c15`; every query with a word those start with (`d`, the `D` of `2-D`) then
   raised in the worker, and the box said "No matching documents". Fixed: each id ends in `;`.
2. Material reads `Word:` as lunr's field syntax and, when the word is no field of the index,
   drops it: a pasted `KeyError: 0` searched for `0` alone. Fixed: the word stays a search term.
3. Material searches every word as a prefix (`word*`), so a heading with many words that only
   start like a short word of the message (`a`, `be`, `0`) outranked the heading that is the
   message. Fixed: each word is searched as itself and as a prefix, so a whole word counts
   twice; a word still being typed matches as before. And a command-line flag in a message
   (`--use-torch-fsdp2`) made lunr's query parser raise (a `-` before a word means "without
   it"), so the box said "No matching documents": the leading dashes of a word are dropped.

Each fix replaces one exact piece of the minified worker; if Material's worker changes, the
build stops and names the fix to redo (or to drop, if the new release fixed it).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError

WORKERS = "assets/javascripts/workers/search.*.min.js"
FIXES = {
    "lunr's token set keys (a word lost, a query that raises)": (
        'e=e+s+o.id}return e}',
        'e=e+s+o.id+";"}return e}',
    ),
    "a word before a colon kept as a search term": (
        'case"FIELD":["title","text","tags"].includes(s)||(e=[e.slice(0,a)," ",e.slice(a+1)].join(""));break;',
        'case"FIELD":["title","text","tags"].includes(s)||(e=[e.slice(0,a)," ",e.slice(a+1)].join(""),'
        'H(s,lunr.tokenizer.separator,(...u)=>{r.push(s.slice(...u))}));break;',
    ),
    "each word searched as itself and as a prefix; a flag's dashes no operator": (
        '.map(r=>/(^[+-]|[~^]\\d+$)/.test(r)?r:`${r}*`).join(" ")',
        '.map(r=>r.replace(/^[-+]{2,}(?=.)/,"")).map(r=>/(^[+-]|[~^]\\d+$)/.test(r)?r:`${r} ${r}*`).join(" ")',
    ),
}


def fixed(source: str, where: str) -> str:
    """The worker's source with every fix made; a fix already made is left as it is."""
    for name, (original, replacement) in FIXES.items():
        if replacement in source and original not in source:
            continue
        if source.count(original) != 1:
            raise PluginError(
                f"{where}: the search fix \"{name}\" found {source.count(original)} copies of the code it "
                "replaces (expected 1): Material's search worker changed. Check whether the new release "
                "still needs the fix, then update or remove it in hooks/search_fixes.py")
        source = source.replace(original, replacement)
    return source


def on_post_build(config):
    workers = sorted(Path(config.site_dir).glob(WORKERS))
    if len(workers) != 1:
        raise PluginError(f"hooks/search_fixes.py: expected one search worker ({WORKERS}) in the built site, "
                          f"found {len(workers)}")
    worker = workers[0]
    source = worker.read_text()
    result = fixed(source, str(worker.relative_to(config.site_dir)))
    if result != source:
        worker.write_text(result)
