"""Small English corpus, written for this project, used to train the tiny models' tokenizer.

The text only has to give byte-level BPE enough common English words and fragments that
prompts tokenize into a plausible number of tokens; it carries no meaning for the models,
whose weights are random.
"""

CORPUS = """\
The cache keeps every token's key and value so the model does not recompute them.
A request arrives, the scheduler admits it, and the worker runs one forward pass.
When memory is full, the oldest pages move from the device to the host.
Each page holds a run of entries, and each entry holds rows for every layer.
Sparse attention reads only the top tokens that the indexer selects for each query.
The indexer scores every earlier token and keeps the best few hundred of them.
Dense attention reads all of the earlier tokens, which costs more as the text grows.
A sliding window layer only looks at the most recent tokens in the sequence.
Recurrent state has a fixed size that does not grow with the length of the prompt.
The mapping table says where each logical address lives right now.
Copy the data first, then update the mapping, and only then send the signal.
Nothing may read an entry while it is halfway between two places.
The morning train left the station at seven and reached the coast by noon.
She opened the window, watered the plants, and made a pot of strong tea.
Our small team wrote the tests before the code, and the tests kept us honest.
He walked along the river to the old mill, where the water turned the wheel.
Please write a short story about a robot who learns to bake bread.
Explain why the sky looks blue during the day and red at sunset.
What is the capital of France, and how many people live there?
List three ways to save energy at home during the winter months.
The quick answer is often wrong; the careful answer takes a little longer.
Numbers such as 1, 2, 3, 10, 42, 100 and 2048 appear in many questions.
If a train travels 60 miles in one hour, how far does it go in three hours?
Add 17 and 25, then multiply the result by 2, and tell me the final number.
The library closes at nine, so return your books before the doors are locked.
Birds sing in the garden while the children play with a red ball.
The engineer measured the time of each step and wrote the results in a table.
Good software is simple to read, easy to test, and hard to misuse.
A user asked the assistant a question, and the assistant gave a clear reply.
The system prompt tells the assistant to be helpful, honest, and brief.
Summarize the following document in two sentences for a busy reader.
The court heard the case for three days before the judge gave a decision.
The plaintiff asked for damages, and the defendant denied every claim.
Farmers plant seeds in spring, tend the fields in summer, and harvest in autumn.
The ship sailed north through cold water until the lights of the harbor appeared.
Learning a new language takes practice, patience, and a lot of listening.
The museum shows paintings, old maps, and tools from many centuries ago.
Rain fell all night, and by morning the streets were shining and quiet.
Write a function that returns the sum of all even numbers in a list.
The function takes two arguments and returns a single value.
Memory, bandwidth, and compute are the three limits of every large model.
Each layer of the network transforms the hidden state of every token.
The tokenizer splits text into pieces, and each piece maps to a number.
Greedy decoding always picks the token with the highest probability.
Two runs with the same seed should produce exactly the same tokens.
The host pool is larger than the device pool but slower to reach.
When a token is selected again soon, keeping it on the device saves a copy.
The least recently used entry is the first one to leave the device.
A bucket collects every slot touched during one scheduling round.
Questions, answers, stories, and lists all help a tokenizer learn common words.
Thank you for your help; the answer was exactly what I needed.
Yes, no, maybe, always, never, sometimes, often, rarely, today, tomorrow.
The cat slept on the warm chair while the dog watched the door.
Mathematics is the study of numbers, shapes, patterns, and change.
The recipe needs two cups of flour, one egg, some milk, and a pinch of salt.
Open the file, read each line, count the words, and print the total.
The weather today is cloudy with a chance of light rain in the evening.
A long document is split into chunks so that each chunk fits in memory.
The student solved the problem step by step and checked the final answer.
"""
