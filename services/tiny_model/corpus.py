"""The text the tiny demo model's tokenizer is trained on: a few KB, written for this purpose.

Mixed prose, dialogue, numbers, code and punctuation so the byte-level BPE learns merges
for the kinds of strings people type at a demo. Changing it changes the tokenizer (and so
every tiny checkpoint): tests build checkpoints from it, they never hard-code token ids."""

CORPUS = """\
The ferry leaves the harbour at seven in the morning and returns at six in the evening.
Passengers buy their tickets at the small office by the pier, where the captain drinks tea
and reads the weather report aloud to anyone who will listen. On calm days the crossing takes
forty minutes; when the wind comes from the west it can take more than an hour.

A ferry is a ship that carries people, cars and goods across a stretch of water. Some ferries
cross rivers, some cross lakes, and some cross the open sea between islands. The oldest ferries
were rafts pulled along a rope; the newest are fast catamarans with engines of many thousand
horsepower. What they share is a timetable, a landing on each side, and a crew that knows the
water better than anyone.

"Is this the boat to the island?" asked the traveller.
"It is," said the deckhand. "Sit on the left side if you want to see the lighthouse."
"How long until we arrive?"
"About forty minutes, if the tide is kind to us."

The harbour master keeps a log of every departure: the time, the number of passengers, the
number of cars, and the state of the sea. In the summer of 1987 the ferry carried 12,450
passengers in a single month, a record that stood for twenty years. In winter the numbers fall
to a few hundred, mostly farmers, teachers and the postman.

Mixture-of-experts models work a little like a busy harbour. Each token arrives at a router,
which sends it to a few experts out of many. Only the chosen experts do any work for that
token, so a large model can answer quickly. When the experts do not fit in the memory of the
graphics card, they wait in host memory and are ferried across the bus when they are needed.
A cache keeps the most useful experts close at hand, and the least recently used ones are
sent back to make room.

def plan(budget, weights, workspace):
    remaining = budget - weights - workspace
    if remaining < 0:
        raise ValueError("the model does not fit in the budget")
    return {"kv_pages": remaining // 2, "expert_slots": remaining // 4}

for step in range(10):
    tokens = scheduler.next_batch()
    logits = model.forward(tokens)
    print(step, tokens.shape, logits.shape)

Questions and answers:
Q: What is the capital of France? A: Paris.
Q: How many days are there in a week? A: Seven.
Q: What colour is the sky on a clear day? A: Blue.
Q: What is two plus two? A: Four.
Q: Who keeps the lighthouse? A: The keeper, who lives in the cottage at its foot.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192.
Dates: 2024-01-15, 2025-06-30, 12:30, 09:45, 18:00.
Punctuation: commas, full stops. Questions? Exclamations! Colons: semicolons; dashes - and
brackets (like these) [and these] {and these}. Quotes "double" and 'single'.

The weather was fine on Tuesday. On Wednesday it rained all day, and the ferry ran late.
On Thursday the sea was rough and the crossing was cancelled. On Friday the sun came out
again, the gulls followed the boat, and the children on the upper deck threw bread into
the air. By Saturday everyone had forgotten the storm.

Hello! How are you today? I am fine, thank you. Can you help me with a question about the
timetable? Of course. The first ferry leaves at seven, the second at nine, and then every
two hours until six. The last ferry back leaves the island at eight in the evening.
"""
