# ruff: noqa  (a test document: the whitespace noise is on purpose)
def f(x):
	if x:
		return  [x,
		        x]
	s = """keep
	tab  here"""
	return s
