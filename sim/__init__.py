"""The discrete-event simulator (``flying-sim``): the router's own policy against a step-time cost model of a GPU
node, for static DP, static TP and dynamic binding on the paper's workload or a trace."""
