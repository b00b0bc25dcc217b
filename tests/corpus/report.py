# ruff: noqa  (a test document: the whitespace noise is on purpose)
"""Report builder.  

Docstring lines keep their trailing spaces:   
and a tab	inside.
"""

import textwrap  



HEADER = '''Name  Qty
widget		2   



gadget  10  '''

SEP  =  "  |  "   # aligned  comment
TAB = "a	b"
QUOTE = 'it''s  two'
PATH = r'C:\\dir  name\\'


def render(rows,  width=10):  
    """Render rows.  

    Args:  
        rows: pairs of  (name, qty).
    """
    out = [HEADER]   
    for name,  qty in rows:
        out.append(f"{name:<{width}}  {qty}")  
        out.append(f'{name}  {qty}')
    # don't  touch: 'quoted  text'
    return  SEP.join(out)



class  Totals:
    note = """multi
line   
with	tab"""

    def total(self, rows):
        return sum(q for _,  q in rows)   
