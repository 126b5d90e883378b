"""Prompts for the engine identity tests: mixed lengths, Chinese, two > 300 tokens sharing a prefix."""

LONG_CONTEXT = (
    "The history of computing is a story of people trying to make arithmetic cheaper. In the seventeenth "
    "century Blaise Pascal built a mechanical adder to help his father, a tax collector, and Gottfried "
    "Leibniz followed with a stepped drum that could multiply. Two hundred years later Charles Babbage "
    "designed the Difference Engine to print mathematical tables without human error, and then the "
    "Analytical Engine, a general machine with a store, a mill, and punched cards borrowed from the "
    "Jacquard loom. Ada Lovelace wrote notes on it that described a program for Bernoulli numbers and "
    "argued that such a machine could manipulate symbols of any kind, not only numbers. The engines were "
    "never finished, partly for money and partly because the workshops of the time could not hold the "
    "tolerances. In the 1930s and 1940s electromechanical relays and then vacuum tubes changed the scale "
    "of the problem. Konrad Zuse built the Z3 in Berlin, Howard Aiken the Harvard Mark I, and at the "
    "University of Pennsylvania a team led by John Mauchly and Presper Eckert built ENIAC to compute "
    "artillery tables. ENIAC was programmed by rewiring panels, a job done largely by six women whose "
    "work was ignored for decades. The stored-program idea, written up by John von Neumann after "
    "discussions with the ENIAC team, put instructions and data in the same memory, and machines such as "
    "the Manchester Baby and EDSAC ran the first such programs in 1948 and 1949. Transistors replaced "
    "tubes in the 1950s, integrated circuits replaced discrete transistors in the 1960s, and the "
    "microprocessor put a whole central processing unit on one chip in 1971. "
)
LONG_A = LONG_CONTEXT + "Question: in one sentence, what made the Analytical Engine different? Answer:"
LONG_B = LONG_CONTEXT + "Question: who programmed ENIAC, and how? Answer:"

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is the boiling point of water in Celsius?<|im_end|>\n<|im_start|>assistant\n",
    "请用中文简单介绍一下长城的历史。",
    LONG_A,
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    LONG_B,
    "Translate to French: I love programming 🚀 and",
]
